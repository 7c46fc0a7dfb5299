"""OpenAI's Batch API (docs/architecture.md, "The api/ folder and its packages"): the
`batches` and `files` blueprints (`routes`, `files`), a batch file's lines (`lines`), a
batch's record in Redis (`store`) and the `llmq batch` commands (`cli`)."""
