"""OpenAI's Responses API on the job system (docs/architecture.md, "The api/ folder and its
packages"): the blueprint (`routes`), the typed request and its chat request (`requests`),
and the stream events derived from a job's events (`events`)."""
