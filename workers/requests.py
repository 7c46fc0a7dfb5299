"""A validated request body turned into engine work: the choices to generate and how.

The API validated the body already (pydantic); this module still treats it as untrusted
input from Redis, so anything it cannot use becomes a 400 for that job, never a crash.
Every engine error a user can cause (empty prompt, bad sampling values, no chat template)
is found here, and the context check when the choices join the generator
(`workers.running`), both before the first token; each becomes `InvalidJobRequest` with the
field the engine's error names (`LLMQRuntimeError.param`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.engine import Engine
from runtime.errors import AdapterNotFoundError, LLMQRuntimeError
from runtime.reasoning import opens_inside, thinks
from runtime.request import GenerationSpec, prompt_list
from runtime.sampling import SamplingParams
from workers.errors import InvalidJobRequest, JobFailure, UnknownAdapterError
from workers.wire.errors import engine_refusal
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, JobRecord


@dataclass
class ChoicePlan:
    """One sequence to generate; `params` carries its stop strings to the engine."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo_text: str = ""
    echo_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None


@dataclass
class JobPlan:
    endpoint: str
    spec: GenerationSpec
    choices: list[ChoicePlan] = field(default_factory=list)
    prompt_tokens: int = 0
    # a chat answer of a thinking model (runtime/reasoning.py): None where the model does not
    # think, else whether the prompt leaves the answer inside its `<think>` block
    thinking: bool | None = None

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token to report; None: no logprobs."""
        return self.spec.logprobs


def plan_generation(engine: Engine, record: JobRecord) -> JobPlan:
    """The choices of a completions or chat completions job, from the spec the API's schemas
    made (`record.spec`; a record without one, from an API that predates it, is read from
    its body by the same reader). Raises InvalidJobRequest with the field the engine named;
    the context check comes when the choices join the generator (`workers.running`), against
    the generator that will run them."""
    if record.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
        raise InvalidJobRequest(f"endpoint {record.endpoint!r} does not generate text")
    chat = record.endpoint == CHAT_COMPLETIONS
    try:
        if record.spec is not None:
            spec = GenerationSpec.from_record(record.spec)
        else:
            spec = GenerationSpec.from_body(record.request, chat=chat)
        if spec.chat != chat:
            raise InvalidJobRequest(f"the job's spec does not fit {record.endpoint}")
        if spec.chat:
            return _plan_chat(engine, spec)
        return _plan_completions(engine, spec)
    except LLMQRuntimeError as exc:
        raise invalid_request(exc) from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidJobRequest(f"invalid request: {exc}") from exc


def embedding_inputs(engine: Engine, body: dict[str, Any]) -> list[list[int]]:
    """Token ids of each `input` of an embeddings request."""
    try:
        return [ids for _, ids in _prompts(engine, body.get("input"), "input")]
    except LLMQRuntimeError as exc:
        raise invalid_request(exc) from exc


def invalid_request(exc: LLMQRuntimeError) -> JobFailure:
    """An engine error a user caused, as the 400 its job fails with (`engine_refusal`, the
    API's conversion too); an adapter the engine does not have is a 404, which only a
    worker meets: the API never holds adapters."""
    if isinstance(exc, AdapterNotFoundError):
        return UnknownAdapterError(str(exc), param="lora")
    return engine_refusal(exc, InvalidJobRequest)


def _plan_completions(engine: Engine, spec: GenerationSpec) -> JobPlan:
    assert spec.prompts is not None and spec.max_tokens is not None
    choice_params = spec.choice_params(spec.max_tokens)  # validates every field
    plan = JobPlan(COMPLETIONS, spec)
    for text, ids in _prompts(engine, spec.prompts, "prompt"):
        plan.prompt_tokens += len(ids)
        echo_logprobs = None
        if spec.echo and spec.logprobs is not None:
            adapters = engine.adapter_stack(spec.adapter_pairs())
            scored = engine.prompt_logprobs(ids, spec.logprobs, adapters)
            echo_logprobs = [(t, lp, top) for t, (lp, top) in zip(ids, scored, strict=True)]
        for params in choice_params:
            plan.choices.append(
                ChoicePlan(
                    index=len(plan.choices),
                    prompt_ids=ids,
                    params=params,
                    echo_text=text if spec.echo else "",
                    echo_logprobs=echo_logprobs,
                )
            )
    return plan


def _plan_chat(engine: Engine, spec: GenerationSpec) -> JobPlan:
    assert spec.messages is not None
    prompt = engine.text.chat_prompt(spec.messages, spec.prompt_tools)
    ids = engine.text.encode(prompt, add_special=False)
    max_tokens = spec.max_tokens
    if max_tokens is None:  # OpenAI: as many as fit; an over-long prompt still gets a 400
        max_tokens = max(1, engine.context_length - len(ids))
    plan = JobPlan(CHAT_COMPLETIONS, spec, prompt_tokens=len(ids))
    if thinks(engine.chat_template.source):
        plan.thinking = opens_inside(prompt)
    for params in spec.choice_params(max_tokens, engine.chat_template.format, plan.thinking):
        plan.choices.append(ChoicePlan(len(plan.choices), ids, params))
    return plan


def _prompts(engine: Engine, value: Any, name: str) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt: a string, a list of strings, a list of token ids,
    or a list of lists of token ids (OpenAI's four forms)."""
    out = []
    for item in prompt_list(value, name):
        ids_given = isinstance(item, list) and all(isinstance(t, int) for t in item)
        if not isinstance(item, str) and not ids_given:
            raise InvalidJobRequest(
                f"each {name} must be a string or a list of token ids", param=name
            )
        ids = engine.text.prompt_ids(item, name)
        out.append((item if isinstance(item, str) else engine.tokenizer.decode(ids), ids))
    return out
