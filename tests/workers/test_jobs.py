"""A job's choices as the worker runs them, without Redis: resuming from what an earlier
attempt streamed. (The text itself is the engine's: tests/runtime/test_text_assembler.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.chat_template import ChatTemplate
from runtime.engine import Engine
from workers.jobs import ActiveJob
from workers.progress import StreamedChoice, StreamProgress
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, JobRecord


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    return Engine.load(str(tiny_model))


def run(engine: Engine, job: ActiveJob, sequences: list | None = None) -> dict:
    generator = engine.new_generator()
    for request_id, prompt, params in job.start(engine) if sequences is None else sequences:
        generator.add(request_id, prompt, params, resume=job.resumed.get(request_id, 0))
    while len(generator):
        for event in generator.step():
            if job.on_token(int(event.request_id.rsplit(":", 1)[1]), event):
                generator.abort(event.request_id)
    assert job.result is not None
    return job.result


def new_job(endpoint: str, body: dict, progress: StreamProgress | None = None) -> ActiveJob:
    record = JobRecord("j1", endpoint, "tiny-llama", body, created_at=1_700_000_000.0)
    return ActiveJob(record, 2, "w:2", None, None, progress or StreamProgress())


def resumed_alike(
    engine: Engine, body: dict, events: list[dict], cut: int, reference: dict
) -> ActiveJob:
    """The chat job of `body` run again, resumed after the first `cut` of the stream entries
    `events` of its first run, whose body `reference` it must give (less the prompt's
    cached tokens: only a resumed run finds its prompt in the prefix cache)."""
    progress = StreamProgress(length=cut)
    progress.choices[0] = StreamedChoice(
        [e["token_id"] for e in events[:cut]], [e["text"] for e in events[:cut]]
    )
    job = new_job(CHAT_COMPLETIONS, body, progress)
    resumed = run(engine, job)
    uncached = [{**done, "usage": dict(done["usage"])} for done in (resumed, reference)]
    for done in uncached:
        done["usage"].pop("prompt_tokens_details")
    assert uncached[0] == uncached[1], f"resumed after {cut} tokens"
    return job


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
def test_a_resumed_job_continues_after_the_streamed_tokens(engine, endpoint):
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    if endpoint == COMPLETIONS:
        body["prompt"] = "resume"
    else:
        body |= {"messages": [{"role": "user", "content": "resume"}], "logprobs": True}
    first = new_job(endpoint, body)
    reference = run(engine, first)
    sent = [json.loads(data) for _, data in first.pending[:5]]
    progress = StreamProgress(length=5)
    progress.choices[0] = StreamedChoice(
        [t["token_id"] for t in sent], [t["text"] for t in sent], [t["logprobs"] for t in sent]
    )

    second = new_job(endpoint, body, progress)
    sequences = second.start(engine)
    [(_, prompt, params)] = sequences
    assert prompt[-5:] == progress.choices[0].token_ids and params.max_tokens == 7
    resumed = run(engine, second, sequences)
    assert [json.loads(d)["index"] for _, d in second.pending] == list(range(5, 12))
    # same tokens and text; logprobs equal up to float noise (prefill vs decode kernels);
    # only the resumed run can find its prompt in the prefix cache
    for body in (resumed, reference):
        body["usage"].pop("prompt_tokens_details")
    assert rounded(resumed) == rounded(reference)


def rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def test_a_choice_that_ended_before_the_crash_is_not_generated_again(engine):
    body = {"prompt": "done", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    first = new_job(COMPLETIONS, body)
    reference = run(engine, first)
    sent = [json.loads(data) for _, data in first.pending]
    progress = StreamProgress(length=3)
    progress.choices[0] = StreamedChoice(
        [t["token_id"] for t in sent], [t["text"] for t in sent], [], "length"
    )
    again = new_job(COMPLETIONS, body, progress)
    assert again.start(engine) == [] and again.result == reference


def test_a_choice_the_engine_ends_with_an_error_fails_the_job_with_a_500(engine):
    """A grammar matcher that fails (it never should) must not finish the job with output
    that may not match the caller's schema: the job fails, with the engine's reason."""
    body = {"prompt": "x", "max_tokens": 6, "temperature": 0, "regex": "[0-9]{6}"}
    job = new_job(COMPLETIONS, body)
    generator = engine.new_generator()
    for request_id, prompt, params in job.start(engine):
        generator.add(request_id, prompt, params)
    letter = engine.encode("x", add_special=False)[0]
    generator._waiting[0].grammar.matcher.consume_token(letter)  # what should never happen
    while len(generator):
        for event in generator.step():
            job.on_token(0, event)
    assert job.result is None and job.failure is not None
    error = job.failure.body()
    assert error["status"] == 500 and error["error"]["code"] == "constrained_decoding_failed"
    assert "constrained decoding failed" in error["error"]["message"]


# a short template that shows the tools itself: the fallback's prompt overflows the tiny
# model's 256 tokens
SHORT_TOOLS_TEMPLATE = (
    "{% for t in tools %}{{ t.function.name }} {% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"n": {"enum": [1, 2, 3]}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}
CALLING = {  # a chat body whose answer must call PICK
    "messages": [{"role": "user", "content": "pick"}],
    "tools": [PICK],
    "tool_choice": "required",
    "max_tokens": 160,  # the tiny vocabulary spells the call's fixed text in many tokens
    "temperature": 0,
}


def test_a_job_resumed_inside_a_tool_call_names_and_finishes_it_as_before(tiny_model):
    """The parser is rebuilt from the streamed text, so the resumed attempt's deltas carry
    on where the first stopped and the body (call ids included) is the one it would give."""
    engine = Engine.load(str(tiny_model))
    engine.chat_template = ChatTemplate(SHORT_TOOLS_TEMPLATE)
    body = {**CALLING, "parallel_tool_calls": False}
    first = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, first)
    message = reference["choices"][0]["message"]
    assert reference["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["tool_calls"][0]["id"].startswith("call_")
    events = [json.loads(data) for _, data in first.pending]
    cut = next(i for i, e in enumerate(events) if e["delta"].get("tool_calls")) + 1
    second = resumed_alike(engine, body, events, cut, reference)
    later = [json.loads(data)["delta"] for _, data in second.pending]
    assert later == [e["delta"] for e in events[cut:]]  # no call started twice


THINKING_TEMPLATE = (  # Qwen3's shape: past turns' thinking is written back inside <think>
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)

THINKING = {  # a chat body held to a think block, then an answer, by a regex
    "messages": [{"role": "user", "content": "think"}],
    "regex": "<think>\n[a-z]{4,12}\n</think>\n\n[a-z]{2,8}",
    "max_tokens": 64,
    "temperature": 0,
}


def test_a_thinking_models_thinking_is_returned_apart_and_resumes_alike(tiny_model):
    """The answer is held to `<think>...</think>...` by a regex, so the tiny model thinks;
    the body and the stream deltas carry the thinking as `reasoning_content`, never in the
    content, and a job resumed at any token gives the same deltas and body."""
    engine = Engine.load(str(tiny_model))
    engine.chat_template = ChatTemplate(THINKING_TEMPLATE)
    body = THINKING
    first = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, first)
    message = reference["choices"][0]["message"]
    events = [json.loads(data) for _, data in first.pending]
    text = "".join(e["text"] for e in events)
    thinking, answer = text.removeprefix("<think>\n").split("\n</think>\n\n")
    assert message["reasoning_content"] == thinking + "\n" and message["content"] == answer
    deltas = [e["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking + "\n"
    assert "".join(d.get("content", "") for d in deltas) == answer
    for cut in range(1, len(events)):
        resumed_job = resumed_alike(engine, body, events, cut, reference)
        assert [json.loads(d)["delta"] for _, d in resumed_job.pending] == deltas[cut:]
