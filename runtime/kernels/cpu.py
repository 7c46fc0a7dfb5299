"""What this CPU can do fast, and the kernel each kind of weight gets on it.

The machines llmq runs on differ (AVX2 only; AVX-512; AVX512-BF16; AMX), and torch's
quantized products differ with them: a bf16 product without AVX512-BF16 converts every
element in software and was measured 5-8x slower than float32 BLAS on an AVX2 EPYC, while
torch's int4 kernel beats BLAS there only for a few rows. The plan is chosen once per
process from /proc/cpuinfo and printed by the benches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from runtime.kernels.cpu_features import CpuFeatures, cpu_features
from runtime.kernels.native import dense_rows, int8_rows, lowbit_builds


@dataclass(frozen=True)
class KernelPlan:
    """The storage and product of each kind of weight."""

    # GGUF Q4_0 / Q4_1 / Q4_K; "int4" also takes Q5_0 / Q5_1 / Q5_K where lowbit_rows.c builds
    # (runtime/kernels/torch_backend.py `LowBitWeight`)
    four_bit: str
    # Q5_* (where not int4's), Q6_K and Q8_0 (where not `eight_bit`'s), F16, BF16, F32
    # weights: "bf16", "fp16" (fbgemm) or "fp16-rows" (dense_rows.c)
    other: str
    # the LM head (and Gemma's tied 262k-row embedding): "int8" (per row), a dense kind, or
    # "file": multiplied as a layer weight of its type would be (Q8_0 from its codes)
    head: str
    threads: int
    # the head's kind where int8 per row is not accurate enough: "bf16", "fp16" or
    # "int4+rescore" (torch_backend.RescoredHead)
    head_fallback: str = "bf16"
    # the host path's KV pool: "float32", or "float16" (`LLMQ_KV_CACHE`; llama.cpp's cache
    # type): half the memory per token and half the bytes decode attention reads (5% of a
    # 32-sequence step at 500 tokens of context, bench/log/2026-11-24-avx512-bf16-epyc.md),
    # but SmolLM2's teacher-forced top-1 against float32 fell from >= 97% to 96.5%, below
    # the bar tests/runtime/test_golden.py holds the default to
    kv: str = "float32"
    # the kind of a head of more than LARGE_HEAD_ROWS rows, where it is not `head`'s ("":
    # the same rules as any head): on AVX2 "int4+rescore", since fp16 read all of Gemma 3's
    # 262k-row head, 335 MB, at every decode step (bench/log/2026-11-24-avx2-epyc.md)
    large_head: str = ""
    # Q8_0 and Q6_K (and Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4: gguf_blocks.py EIGHT_BIT_TYPES,
    # TWO_BIT_TYPES): the file's codes through int8_rows.c, "int8-block-groups" (16 rows
    # side by side, torch_backend.py `Int8BlockGroupWeight`; the types a nibble indexes
    # as 4-bit indices, `NibbleGroupWeight`) or "int8-blocks" (a row at a time,
    # `Int8BlockWeight`; `LLMQ_INT8_LAYOUT=rows`), or "" for `other`'s kind
    eight_bit: str = ""

    def describe(self) -> dict[str, str]:
        described = {
            "4-bit weights": self.four_bit,
            **({"8-bit weights": self.eight_bit} if self.eight_bit else {}),
            "other weights": self.other,
            "lm head": f"{self.head} (else {self.head_fallback})",
            "kv cache": self.kv,
            "threads": str(self.threads),
        }
        if self.large_head:
            described["lm head"] += f"; over {LARGE_HEAD_ROWS:,} rows {self.large_head}"
        return described


LARGE_HEAD_ROWS = 100_000  # SmolLM2's head has 49,152 rows, Gemma 3's 262,144
# A head of over LARGE_HEAD_ROWS rows on every plan: an int4 ranking rescored from the
# file's rows (torch_backend.RescoredHead), where the file's Q8_0 codes (int8_rows.c's
# grouped layout, two passes) read 180 MiB a step for Gemma 3's against the ranking's 100.
# bench/large_head.py, 2026-11-28: on an AMX Xeon 8.9 / 63.7 ms at 1 / 32 rows against
# the codes' 10.4 / 58.5 (the codes 0.92x the time at 32 rows only); with the AVX2 build
# there 9.9 / 79 against 13.8 / 152. Decode's single row decides, and the resident bytes.
# The ranking (like int8 per row) serves greedy rows only: a row whose logits are seen or
# sampled from takes the file's codes (torch_backend.FileHead, built on first use).
LARGE_HEAD_KIND = "int4+rescore"


def plan_for(features: CpuFeatures) -> KernelPlan:
    """The kernels for this CPU: `row_invariant_plan`'s on every kind (bench/RESULTS.md has
    the measurements behind them). Before, the AVX2 plan took fbgemm's fp16 for the head and
    the 8-bit weights, whose rows moved with their batch: a LoRA request answered
    differently alone and in a batch there.

    - AVX-512: GGUF's 4- and 5-bit types as "int4": runtime/kernels/lowbit_rows.c (all
      210 SmolLM2 layer products 2.0 ms at 1 row and 24 ms at 32, where torch's int4 took
      4.5 / 44 and float32 BLAS 21.7 / 58.9), else torch's int4; the other types
      fbgemm's fp16, whose rows do not depend on their batch there (AMX's bf16 did, from
      64 rows); a head int8 cannot hold, an int4 ranking plus rescoring.
    - AVX2 only: torch's int4 and int8 kernels convert every weight for every row (at 32
      rows 144 ms where float32 BLAS took 78), so every weight goes to the engine's own
      kernels: the 4- and 5-bit types to lowbit_rows.c's AVX2 build (vpmaddubsw; 2.8 / 44
      ms for those products, measured on the AVX-512 EPYC with AVX-512 turned off at
      compile time), Q8_0 and Q6_K as the file's codes to int8_rows.c (llama.cpp's AVX2
      Q8_0 x Q8_0 dot: half fp16's bytes), the head as its file type says, and what the
      file holds as F16/BF16/F32 to dense_rows.c's fp16. A head of more than
      LARGE_HEAD_ROWS rows ranks with lowbit_rows.c's int4 and rescores its best rows from
      the file (torch_backend.RescoredHead): SmolLM2's head ranked in 0.55 ms at 1 row
      where fp16 took 2.2, but its rescoring costs ~0.7 ms a query row; a head five times
      larger gains the ranking's saving five times over.
    - The LM head int8 per row on AVX-512 wherever its rows allow it
      (torch_backend.MAX_INT8_ROW_ERROR), else the plan's fallback: int8 per row cost
      Gemma 3 (rows with outliers) 1-2 points of teacher-forced top-1.
    """
    return row_invariant_plan(features)


# "rows": Q8_0 / Q6_K a weight row at a time (int8_rows.c `llmq_int8_blocks`), the layout
# before the grouped one, kept for benches' A/B; default "groups"
INT8_LAYOUT_ENV = "LLMQ_INT8_LAYOUT"
KERNELS_ENV = "LLMQ_KERNELS"  # "row-invariant" (default; "cpu" names it too) or "fp16"
KV_CACHE_ENV = "LLMQ_KV_CACHE"  # "float32" (default) or "float16"
KV_CACHE_TYPES = ("float32", "float16")
PLAN_NAMES = ("row-invariant", "cpu", "fp16")


def row_invariant_plan(features: CpuFeatures) -> KernelPlan:
    """Only kernels whose result for a row does not depend on how many rows they are given
    (bench/invariance.py checks them on this CPU), so with runtime/kernels/paged_attention.c
    and LoRA deltas in a fixed order (runtime/lora.py) a sequence's logits are bitwise the
    same alone, batched, cached or resumed. AVX-512: lowbit_rows.c (else torch's int4),
    Q8_0 / Q6_K from their codes (int8_rows.c) and int8 per row for the head; fbgemm's fp16
    for the other weights, row-invariant at every shape tried there, where oneDNN's bf16
    product sums a row of a long one differently from some batch on (K >= 1536 from 16 rows
    on an AVX512-BF16 EPYC; with AMX, on an Emerald Rapids Xeon, K = 512 from 64 rows:
    tests/runtime/test_row_invariance.py). With fp16 in place of AMX's bf16 for Gemma 3's
    Q6_K / Q8_0 weights its teacher-forced top-1 against float32 fell from 98.5% to 98.2%;
    from their codes it is 98.5%. A head that int8 per row
    cannot hold ranks with an int4 copy and rescores its best rows from the file
    (torch_backend.RescoredHead). AVX2: the engine's C kernels for every weight
    (`plan_for`); where they cannot be built, torch's int4, int8 and bf16, row-invariant
    but slow there."""
    if features.level in ("amx", "avx512_bf16", "avx512"):
        eight_bit = eight_bit_kind() if int8_rows() is not None else ""
        return KernelPlan(
            "int4",
            "fp16",
            "int8",
            features.cores,
            head_fallback="int4+rescore",
            large_head=LARGE_HEAD_KIND,
            eight_bit=eight_bit,
        )
    if lowbit_builds() and dense_rows() is not None and int8_rows() is not None:
        return KernelPlan(
            "int4",
            "fp16-rows",
            "file",
            features.cores,
            head_fallback="fp16-rows",
            large_head=LARGE_HEAD_KIND,
            eight_bit=eight_bit_kind(),
        )
    return KernelPlan("int4", "bf16", "int8", features.cores, head_fallback="int4+rescore")


def eight_bit_kind() -> str:
    """Q8_0 / Q6_K's layout for int8_rows.c: 16 weight rows side by side (each activation
    block loaded once per 16 rows, VNNI's 512-bit vpdpbusd where the build has it), unless
    `LLMQ_INT8_LAYOUT=rows` asks for a row at a time. bench/int8_layouts.py on an AMX Xeon:
    Gemma 3's Q6_K ffn_down 4.3x faster at 480 rows and 2.0x at one; SmolLM2's Q8_0 head
    4.6x at 32 rows; the AVX2 build 1.8x / 1.2x / 2.1x."""
    layout = os.environ.get(INT8_LAYOUT_ENV) or "groups"
    if layout not in ("groups", "rows"):
        raise ValueError(f"{INT8_LAYOUT_ENV} must be groups or rows, got {layout!r}")
    return "int8-block-groups" if layout == "groups" else "int8-blocks"


def default_plan() -> KernelPlan:
    """The plan `LLMQ_KERNELS` names, else this CPU's (`plan_for`), with the KV cache type
    `LLMQ_KV_CACHE` names."""
    name = os.environ.get(KERNELS_ENV) or "row-invariant"
    kv = os.environ.get(KV_CACHE_ENV) or "float32"
    if kv not in KV_CACHE_TYPES:
        raise ValueError(f"{KV_CACHE_ENV} must be one of {', '.join(KV_CACHE_TYPES)}, got {kv!r}")
    features = cpu_features()
    if name in ("row-invariant", "cpu"):  # the CPU's plan is the row-invariant one
        plan = row_invariant_plan(features)
    elif name == "fp16":
        plan = fp16_plan(features.cores)
    else:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(PLAN_NAMES)}, got {name!r}")
    return replace(plan, kv=kv)


def fp16_plan(threads: int) -> KernelPlan:
    """fbgemm's fp16 for every weight, on any AVX2 CPU. Its products take float32
    activations, so two forward passes over the same weights round alike wherever their
    own float32 code does; int4, int8 and bf16 round activations to bf16 first, where a
    last-bit difference upstream becomes a bf16 step (tests comparing two forward passes
    name this plan)."""
    return KernelPlan("fp16", "fp16", "fp16", threads, head_fallback="fp16")
