"""`GenerationSpec`: one generation request as the engine needs it, whoever sends it.

The API validates a request body with its pydantic schemas, which produce the spec
(`to_spec()`, through `from_body`: the one reader, nothing else picks sampling fields out of
a body); the job record stores it (`to_record`) next to the body, and the worker reads it
back (`from_record`) and turns it into one `SamplingParams` per choice with
`choice_params`. `llmq generate` could build one directly.

A record comes back from Redis, so `from_record` treats it as untrusted: every value it
cannot use raises an `LLMQRuntimeError` whose `param` names the field. Structured output is
the `constraint` field (`runtime.constraints.Constraint`, read by `constraint_from_request`),
given to every choice's `SamplingParams`. LoRA adapters are `adapters` (the body's `lora`:
`{"name", "scale"}` each), resolved by the engine that runs the job (`Engine.adapter_stack`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from runtime.chat_formats import ChatFormat
from runtime.constraints import Constraint, constraint_from_request
from runtime.errors import AdapterError, EmptyPromptError, InvalidSamplingParams
from runtime.limits import DEFAULT_COMPLETION_TOKENS, MAX_CHOICES
from runtime.sampling import SamplingParams
from runtime.tool_calls import calls_possible, check_tools, tool_grammar

# fields of a body that go to every choice's SamplingParams unchanged
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
)


@dataclass
class GenerationSpec:
    """What to generate: `prompts` (completions) or `messages` (chat), `n` choices each,
    sampled with `sampling` and stopped by `stop` or `max_tokens` (None: as many as the
    context leaves, OpenAI's chat default). `logprobs` alternatives per token (None: no
    logprobs); `echo` returns the prompt before the completion (completions only);
    `constraint`: the grammar every choice's output must match (structured output).
    `tools`, `tool_choice` (None: "auto" with tools), `parallel_tool_calls`: OpenAI's tool
    calling (chat only); the tools go into the prompt and, unless the choice is "none",
    a grammar keeps calls valid (`runtime.tool_calls`)."""

    prompts: list[Any] | None = None  # strings or lists of token ids
    messages: list[dict[str, Any]] | None = None
    n: int = 1
    max_tokens: int | None = DEFAULT_COMPLETION_TOKENS
    sampling: dict[str, Any] = field(default_factory=dict)  # SAMPLING_FIELDS that were set
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    echo: bool = False
    cache_prompt: bool = True
    constraint: Constraint | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    adapters: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "scale"}]

    @property
    def chat(self) -> bool:
        return self.messages is not None

    @property
    def calls_possible(self) -> bool:
        """Whether the output is parsed for tool calls."""
        return calls_possible(self.tools, self.tool_choice)

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows the model: none when it may not call them."""
        return self.tools if self.calls_possible else None

    def output_constraint(
        self, fmt: ChatFormat | None = None, thinking: bool | None = None
    ) -> Constraint | None:
        """What every choice must match: the response format, else the tool-call grammar in
        the model's format (`fmt`; Hermes where the model is not known), after the thinking
        block the prompt leaves open (`thinking`)."""
        if self.constraint is not None or not self.calls_possible:
            return self.constraint
        assert self.tools is not None
        return tool_grammar(
            self.tools, self.tool_choice, self.parallel_tool_calls, fmt, bool(thinking)
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any], *, chat: bool) -> GenerationSpec:
        """The spec of an OpenAI completions (`chat` False) or chat completions body."""
        spec = cls(
            n=_choices_per_prompt(1 if body.get("n") is None else body["n"]),
            sampling={k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None},
            seed=body.get("seed"),
            stop=body.get("stop") or [],
            cache_prompt=body.get("cache_prompt") is not False,
            constraint=constraint_from_request(body),
            adapters=adapter_list(body.get("lora") or []),
        )
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise EmptyPromptError(
                    "messages must be a non-empty list of chat messages", param="messages"
                )
            spec.messages = messages
            spec.max_tokens = body.get("max_completion_tokens")
            if spec.max_tokens is None:
                spec.max_tokens = body.get("max_tokens")
            spec.logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
            spec.tools = body.get("tools") or None
            spec.tool_choice = body.get("tool_choice")
            spec.parallel_tool_calls = body.get("parallel_tool_calls") is not False
            spec.check_tools()
        else:
            spec.prompts = prompt_list(body.get("prompt"), "prompt")
            if body.get("max_tokens") is not None:
                spec.max_tokens = body["max_tokens"]
            spec.logprobs = body.get("logprobs")
            spec.echo = bool(body.get("echo"))
        spec.check_choices(len(spec.prompts or [None]))
        return spec

    def to_record(self) -> dict[str, Any]:
        """The spec as JSON-ready data, for the job record."""
        return asdict(self)

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> GenerationSpec:
        """A spec read back from a job record (untrusted: it came from Redis)."""
        if not isinstance(data, Mapping):
            raise InvalidSamplingParams("the job's generation spec is not an object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidSamplingParams(
                f"unknown field in the job's generation spec: {unknown[0]}", param=unknown[0]
            )
        spec = cls(**data)
        spec.constraint = _constraint_from_record(spec.constraint)
        spec.adapters = adapter_list(spec.adapters)
        spec.check_tools()
        _choices_per_prompt(spec.n)
        if (spec.prompts is None) == (spec.messages is None):
            raise EmptyPromptError("a generation spec needs prompts or messages, not both")
        if not isinstance(spec.sampling, dict) or set(spec.sampling) - set(SAMPLING_FIELDS):
            raise InvalidSamplingParams("the spec's sampling holds unknown fields")
        if not isinstance(spec.stop, list):
            raise InvalidSamplingParams("stop must be a list of strings", param="stop")
        spec.check_choices(len(spec.prompts or [None]))
        return spec

    def adapter_pairs(self) -> list[tuple[str, float]]:
        """The LoRA adapters as (name, scale), what `Engine.adapter_stack` takes."""
        return [(a["name"], a["scale"]) for a in self.adapters]

    def check_tools(self) -> None:
        check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.tools is not None and not self.chat:
            raise InvalidSamplingParams("tools are for chat completions only", param="tools")
        if self.constraint is not None and self.calls_possible:
            raise InvalidSamplingParams(
                "response_format other than text cannot be combined with tools unless "
                "tool_choice is 'none'",
                param="response_format",
            )

    def check_choices(self, prompts: int) -> None:
        if prompts * self.n > MAX_CHOICES:
            raise InvalidSamplingParams(
                f"a request may ask for at most {MAX_CHOICES} choices (prompts x n), "
                f"got {prompts * self.n}",
                param="n",
            )

    def choice_params(
        self, max_tokens: int, fmt: ChatFormat | None = None, thinking: bool | None = None
    ) -> list[SamplingParams]:
        """Parameters of the `n` choices of one prompt; a seed gives choice j the seed + j,
        so the choices of a seeded request are reproducible and still differ from each other.
        `fmt`: the model's chat format, which the tool-call grammar is written in;
        `thinking`: the prompt leaves the answer inside a `<think>` block."""
        constraint = self.output_constraint(fmt, thinking)
        # a chat answer's markers reach its parser in order with the text (TextAssembler)
        markers = list(fmt.marker_ids) if fmt is not None and self.chat else []
        return [
            SamplingParams(
                max_tokens=max_tokens,
                stop=self.stop,
                logprobs=self.logprobs,
                seed=None if self.seed is None else self.seed + j,
                constraint=constraint,
                marker_token_ids=markers,
                **self.sampling,
            )
            for j in range(self.n)
        ]


def _constraint_from_record(data: Any) -> Constraint | None:
    """The record's constraint (`asdict` of a `Constraint`), rebuilt and so checked again."""
    if data is None:
        return None
    if (
        not isinstance(data, Mapping)
        or set(data) - {"kind", "value", "param"}
        or not isinstance(data.get("param"), str | None)
    ):
        raise InvalidSamplingParams(
            "the spec's constraint must be an object with kind, value and param",
            param="response_format",
        )
    return Constraint(data.get("kind"), data.get("value"), data.get("param"))


def adapter_list(value: Any) -> list[dict[str, Any]]:
    """A request's `lora` as `[{"name": str, "scale": float}]` (scale defaults to 1)."""
    if not isinstance(value, list):
        raise AdapterError(f"lora must be a list of {{name, scale}} objects, got {value!r:.40}")
    adapters = []
    for item in value:
        if not isinstance(item, Mapping) or set(item) - {"name", "scale"}:
            raise AdapterError(
                f"each lora entry must be an object with name and scale, got {item!r:.60}"
            )
        name, scale = item.get("name"), item.get("scale", 1.0)
        if not isinstance(name, str) or not name:
            raise AdapterError(f"a lora entry's name must be a non-empty string, got {name!r:.40}")
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not math.isfinite(scale)
        ):
            raise AdapterError(f"lora {name!r}: scale must be a finite number, got {scale!r:.20}")
        adapters.append({"name": name, "scale": float(scale)})
    return adapters


def _choices_per_prompt(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidSamplingParams(f"n must be a positive integer, got {n!r}", param="n")
    return n


def prompt_list(value: Any, name: str) -> list[Any]:
    """OpenAI's four prompt forms (a string, a list of strings, a list of token ids, a list
    of lists of token ids) as a list of prompts; `name` is the field (prompt, input)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise EmptyPromptError(
        f"{name} must be a string or a non-empty list, got {value!r:.40}", param=name
    )
