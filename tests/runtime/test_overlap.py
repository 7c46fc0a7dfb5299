"""Overlapped decode steps (runtime/generator.py `Generator.step`): the next static step is
launched from the tokens the last one sampled before the host reads them, and it must give
exactly the tokens of the step-by-step loop.

Each case runs the same requests through two engines over the same tiny model on the CPU's
tensor path (the code a GPU runs, uncaptured), one with `overlap=False`, and compares every
event: token ids, texts, finish reasons, in order per request. The cases bring what the
host decides one step late: stop tokens and strings, `max_tokens`, cancels, grammar rows
and host-sampled rows (which drain the pipeline), arrivals mid-stream and preemptions.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from runtime.constraints import Constraint
from runtime.engine import Engine, EngineConfig
from runtime.sampling import SamplingParams


@pytest.fixture
def models(long_models: dict[str, Path]) -> dict[str, Path]:
    return long_models  # tests/runtime/conftest.py


def _engine(path: Path, overlap: bool, **config) -> Engine:
    return Engine.load(
        str(path),
        EngineConfig(backend="torch", device="cpu", torch_forward=True, overlap=overlap, **config),
    )


Request = tuple[str, list[int], SamplingParams]


def _run(engine: Engine, requests: list[Request], script=None) -> tuple[dict, int]:
    """Every request's events as (token, text, finish, preemptions) in order, and the steps
    that were launched overlapped. `script(events, generator)` may add or abort between steps, as a
    worker does when the events it was given tell it to (a cancel flag it then reads)."""
    generator = engine.new_generator()
    for request_id, prompt, params in requests:
        generator.add(request_id, prompt, params)
    events: dict[str, list] = defaultdict(list)
    step = 0
    while len(generator) or (script is not None and step < 60):
        if script is not None:
            script(events, generator)
        for e in generator.step():
            events[e.request_id].append((e.token_id, e.text, e.finish_reason, e.preemptions))
        step += 1
        assert step < 500
    return dict(events), generator.overlapped_steps


def _both(path: Path, requests: list[Request], script=None, **config) -> tuple[dict, dict, int]:
    """`script`: a function making a fresh script for each run."""
    plain, overlapped_plain = _run(_engine(path, False, **config), requests, script and script())
    assert overlapped_plain == 0
    overlapped, launched = _run(_engine(path, True, **config), requests, script and script())
    return plain, overlapped, launched


def _prompts(n: int, length: int = 12) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 20 for j in range(length + i % 5)] for i in range(n)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_and_seeded_rows_give_the_step_by_step_tokens(models, arch):
    params = [
        SamplingParams(max_tokens=20 + i % 7, temperature=0)
        if i % 2
        else SamplingParams(max_tokens=18 + i % 5, temperature=0.9, top_p=0.9, top_k=40, seed=i)
        for i in range(9)
    ]
    requests = [(f"r{i}", p, params[i]) for i, p in enumerate(_prompts(9))]
    plain, overlapped, launched = _both(models[arch], requests)
    assert overlapped == plain
    assert all(len(v) == params[i].max_tokens for i, v in enumerate(plain.values()))
    assert launched > 10  # the overlapped path ran


def test_stop_tokens_and_strings_end_where_they_end_step_by_step(models):
    """A stop token or string is seen one step late: the row was fed once more and its
    token is dropped, never emitted."""
    path = models["llama"]
    prompts = _prompts(6)
    free = SamplingParams(max_tokens=24, temperature=0)
    reference, _ = _run(_engine(path, False), [(f"r{i}", p, free) for i, p in enumerate(prompts)])
    requests = []
    for i, prompt in enumerate(prompts):
        tokens = [event[0] for event in reference[f"r{i}"]]
        text = "".join(event[1] for event in reference[f"r{i}"])
        if i % 3 == 0:
            params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tokens[5 + i]])
        elif i % 3 == 1 and len(text) > 12:
            params = SamplingParams(max_tokens=24, temperature=0, stop=[text[6 + i : 9 + i]])
        else:
            params = free
        requests.append((f"r{i}", prompt, params))
    plain, overlapped, launched = _both(path, requests)
    assert overlapped == plain
    finishes = [events[-1][2] for events in plain.values()]
    assert finishes.count("stop") >= 3  # the stops were met early, not by length
    assert launched > 0


def test_cancels_and_arrivals_between_steps(models):
    """Rows aborted and requests added while a step is in flight, after the same events
    as step by step: the same events (the aborted row's step in flight is dropped)."""
    path = models["llama"]
    prompts = _prompts(8)

    def new_script():
        done: set[str] = set()

        def once(events: dict, name: str, request_id: str, count: int) -> bool:
            if name in done or len(events.get(request_id, [])) < count:
                return False
            done.add(name)
            return True

        def script(events: dict, generator) -> None:
            if once(events, "cancel r1", "r1", 3):
                generator.abort("r1")
            if once(events, "late", "r0", 5):
                generator.add("late", prompts[7], SamplingParams(max_tokens=15, temperature=0))
            if once(events, "cancel r3", "r2", 8):
                generator.abort("r3")
                generator.add("later", prompts[6], SamplingParams(max_tokens=9, seed=3))

        return script

    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=30, temperature=0))
        for i, p in enumerate(prompts[:5])
    ]
    plain, overlapped, launched = _both(path, requests, new_script)
    assert overlapped == plain
    assert len(plain["r1"]) < 30 and len(plain["late"]) == 15 and len(plain["later"]) == 9
    assert launched > 0


def test_grammar_and_host_sampled_rows_drain_the_pipeline(models):
    """A JSON-constrained row needs its mask from the matcher that read the last token, a
    logprobs or penalty row the host sampler: steps with them run step by step, and the
    rows beside them get the same tokens either way."""
    path = models["llama"]
    prompts = _prompts(5)
    requests = [
        ("plain", prompts[0], SamplingParams(max_tokens=20, temperature=0)),
        (
            "json",
            prompts[1],
            SamplingParams(max_tokens=20, temperature=0, constraint=Constraint("json_object")),
        ),
        ("logprobs", prompts[2], SamplingParams(max_tokens=12, temperature=0, logprobs=2)),
        ("penalty", prompts[3], SamplingParams(max_tokens=14, seed=1, presence_penalty=0.5)),
        ("seeded", prompts[4], SamplingParams(max_tokens=26, seed=9)),
    ]
    plain, overlapped, launched = _both(path, requests)
    assert overlapped == plain
    assert launched > 0  # once the host-decided rows ended, the rest overlapped


def test_preemptions_give_the_same_tokens(models):
    """A KV pool too small for every row: the step-by-step path preempts (the overlapped
    one drains first), and every request still gets its tokens."""
    path = models["llama"]
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True))
        for i, p in enumerate(_prompts(16, length=100))
    ]
    config = {"kv_memory_mb": 1, "max_sequences": 16}
    plain, overlapped, launched = _both(path, requests, **config)
    assert overlapped == plain
    assert all(len(v) == 40 for v in plain.values())
    assert sum(events[-1][3] for events in plain.values()) > 0  # rows were preempted
    assert launched > 0
