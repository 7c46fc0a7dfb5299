"""A validated request body turned into engine work: the choices to generate and how.

The API validated the body already (pydantic); this module still treats it as untrusted
input from Redis, so anything it cannot use becomes a 400 for that job, never a crash.
Every engine error a user can cause (context too long, empty prompt, bad sampling values,
no chat template) is checked here, before the first token, and becomes `InvalidJobRequest`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import (
    ChatTemplateError,
    ContextLengthError,
    EmptyPromptError,
    InvalidSamplingParams,
    LLMQRuntimeError,
)
from runtime.sampling import SamplingParams
from workers.errors import InvalidJobRequest
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS

MAX_CHOICES = 64  # n x prompts per job; each choice is a sequence in the batch
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
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
class ChoicePlan:
    """One sequence to generate. `params` has no stop strings: the worker matches `stop`."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    echo_text: str = ""
    echo_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None


@dataclass
class JobPlan:
    endpoint: str
    choices: list[ChoicePlan] = field(default_factory=list)
    prompt_tokens: int = 0
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs


def plan_generation(engine: Any, endpoint: str, body: dict[str, Any]) -> JobPlan:
    """The choices of a completions or chat completions request, each checked by the engine."""
    try:
        if endpoint == COMPLETIONS:
            plan = _plan_completions(engine, body)
        elif endpoint == CHAT_COMPLETIONS:
            plan = _plan_chat(engine, body)
        else:
            raise InvalidJobRequest(f"endpoint {endpoint!r} does not generate text")
        checker = engine.new_batch()
        for choice in plan.choices:
            checker.check_request(choice.prompt_ids, choice.params)
    except LLMQRuntimeError as exc:
        raise _as_invalid(exc, endpoint) from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidJobRequest(f"invalid request: {exc}") from exc
    if len(plan.choices) > MAX_CHOICES:
        raise InvalidJobRequest(
            f"a request may ask for at most {MAX_CHOICES} choices (prompts x n), "
            f"got {len(plan.choices)}",
            param="n",
        )
    return plan


def embedding_inputs(engine: Any, body: dict[str, Any]) -> list[list[int]]:
    """Token ids of each `input` of an embeddings request."""
    try:
        return [ids for _, ids in _prompts(engine, body.get("input"), "input")]
    except LLMQRuntimeError as exc:
        raise _as_invalid(exc, EMBEDDINGS) from exc


def _plan_completions(engine: Any, body: dict[str, Any]) -> JobPlan:
    logprobs = body.get("logprobs")
    echo = bool(body.get("echo"))
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_TOKENS
    choice_params = _choice_params(body, max_tokens, logprobs)  # validates every field
    plan = JobPlan(COMPLETIONS, logprobs=logprobs)
    for text, ids in _prompts(engine, body.get("prompt"), "prompt"):
        plan.prompt_tokens += len(ids)
        echo_logprobs = None
        if echo and logprobs is not None:
            scored = engine.prompt_logprobs(ids, logprobs)
            echo_logprobs = [(t, lp, top) for t, (lp, top) in zip(ids, scored, strict=True)]
        for params in choice_params:
            plan.choices.append(
                ChoicePlan(
                    index=len(plan.choices),
                    prompt_ids=ids,
                    params=dataclasses.replace(params, stop=[]),
                    stop=params.stop,
                    echo_text=text if echo else "",
                    echo_logprobs=echo_logprobs,
                )
            )
    return plan


def _plan_chat(engine: Any, body: dict[str, Any]) -> JobPlan:
    response_format = body.get("response_format") or {}
    if response_format.get("type", "text") != "text":
        raise InvalidJobRequest(
            f"response_format type {response_format.get('type')!r} is not supported yet; "
            "use 'text'",
            param="response_format",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EmptyPromptError("messages must be a non-empty list of chat messages")
    ids = engine.encode_chat(messages)
    logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:  # OpenAI: as many as fit; an over-long prompt still gets a 400
        max_tokens = max(1, engine.context_length - len(ids))
    plan = JobPlan(CHAT_COMPLETIONS, prompt_tokens=len(ids), logprobs=logprobs)
    for params in _choice_params(body, max_tokens, logprobs):
        plan.choices.append(
            ChoicePlan(len(plan.choices), ids, dataclasses.replace(params, stop=[]), params.stop)
        )
    return plan


def _choice_params(
    body: dict[str, Any], max_tokens: int, logprobs: int | None
) -> list[SamplingParams]:
    """Parameters of the `n` choices of one prompt; a seed gives choice j the seed + j, so
    the choices of a seeded request are reproducible and still differ from each other."""
    n = 1 if body.get("n") is None else body["n"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidJobRequest(f"n must be a positive integer, got {n!r}", param="n")
    common = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    seed = body.get("seed")
    return [
        SamplingParams(
            max_tokens=max_tokens,
            stop=body.get("stop") or [],
            logprobs=logprobs,
            seed=None if seed is None else seed + j,
            **common,
        )
        for j in range(n)
    ]


def _prompts(engine: Any, value: Any, name: str) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt: a string, a list of strings, a list of token ids,
    or a list of lists of token ids (OpenAI's four forms)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise EmptyPromptError(f"{name} must be a string or a non-empty list, got {value!r:.40}")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item.strip():
                raise EmptyPromptError(f"{name} is empty: it needs at least one token")
            out.append((item, engine.encode(item)))
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            if not item:
                raise EmptyPromptError(f"{name} is empty: it needs at least one token")
            out.append((engine.tokenizer.decode(item), list(item)))
        else:
            raise InvalidJobRequest(
                f"each {name} must be a string or a list of token ids", param=name
            )
    return out


_PARAMS: dict[type, Callable[[str], str | None]] = {
    InvalidSamplingParams: lambda message: message.split(" ", 1)[0].split("[", 1)[0],
    ContextLengthError: lambda _: None,
    ChatTemplateError: lambda _: "messages",
}


def _as_invalid(exc: LLMQRuntimeError, endpoint: str) -> InvalidJobRequest:
    param: str | None = None
    for kind, guess in _PARAMS.items():
        if isinstance(exc, kind):
            param = guess(str(exc))
            break
    else:
        if isinstance(exc, EmptyPromptError):
            param = {COMPLETIONS: "prompt", CHAT_COMPLETIONS: "messages"}.get(endpoint, "input")
    return InvalidJobRequest(str(exc), param=param)
