"""A head of more than LARGE_HEAD_ROWS rows (Gemma 3's 262k): the plan ranks it with an
int4 copy and rescores each query's best rows from the file (torch_backend.RescoredHead),
on every CPU kind, because that measured faster than the file's own Q8_0 codes at one row
(runtime/kernels/cpu.py LARGE_HEAD_KIND, bench/large_head.py); and that choice keeps the
greedy tokens the file's codes give."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runtime.kernels.cpu import LARGE_HEAD_KIND, CpuFeatures, plan_for
from runtime.kernels.native import int8_rows, lowbit_builds

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "gemma-3-270m.json"
GREEDY_TOKENS = 16

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
AMX = AVX512 | {"avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}


@pytest.mark.parametrize("flags", [AMX, AVX512, AVX2], ids=["amx", "avx512", "avx2"])
def test_every_plan_ranks_a_large_head_and_rescores_it(flags):
    plan = plan_for(CpuFeatures(flags, 2))
    if "avx512f" not in flags and not lowbit_builds():
        pytest.skip("no C compiler: the AVX2 plan keeps torch's kernels")
    assert plan.large_head == LARGE_HEAD_KIND == "int4+rescore"


@pytest.mark.skipif(int8_rows() is None, reason="no C compiler for int8_rows.c")
def test_the_ranked_head_keeps_the_greedy_tokens_of_the_files_codes(gemma3_gguf_path):
    """Gemma 3 greedy on the reference prompts: the plan's ranked and rescored head and the
    file's Q8_0 codes through int8_rows.c (two passes) pick the same tokens; the rows that
    need every logit get the codes head's."""
    from runtime.engine import Engine, EngineConfig
    from runtime.gguf_file import GGUFFile
    from runtime.kernels.cpu import default_plan
    from runtime.models.base import BatchLayout, SequenceChunk
    from runtime.registry import ModelSpec
    from runtime.sampling import SamplingParams

    def engine(large_head: str) -> Engine:
        plan = replace(default_plan(), large_head=large_head)
        spec = ModelSpec("gemma-3-270m", str(gemma3_gguf_path), lambda: gemma3_gguf_path)
        config = EngineConfig(backend="torch", kernels=plan, prefix_cache=False)
        return Engine(spec, GGUFFile(gemma3_gguf_path), config)

    ranked, codes = engine(LARGE_HEAD_KIND), engine("file")
    assert ranked.model.output.kind == "int4+rescore"
    assert codes.model.output.kind.startswith("int8-block")
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt in json.loads(FIXTURE.read_text())["prompts"]:
        ids = prompt["token_ids"]
        got = [e.token_id for e in ranked.generate(ids, greedy)]
        expected = [e.token_id for e in codes.generate(ids, greedy)]
        assert got == expected, (
            f"{prompt['text'][:40]!r}: {np.flatnonzero(np.array(got) != expected)}"
        )
    # a row whose logits are seen or sampled from (logprobs, a temperature) takes the file's
    # codes: every rank bitwise the codes head's (tests/runtime/test_head_precision.py
    # holds both to float32), where the ranking alone was off by up to 2.4 past its best
    layout = BatchLayout([SequenceChunk(ranked.model.new_cache(len(ids)), 0, len(ids))])
    hidden = ranked.model.forward(np.asarray(ids), layout)  # the last prompt's [L, D]
    assert np.array_equal(ranked.model.logits(hidden, True), codes.model.logits(hidden))
