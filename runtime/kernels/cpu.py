"""What this CPU can do fast, and the kernel each kind of weight gets on it.

The machines llmq runs on differ (AVX2 only; AVX-512; AVX512-BF16; AMX), and torch's
quantized products differ with them: a bf16 product without AVX512-BF16 converts every
element in software and was measured 5-8x slower than float32 BLAS on an AVX2 EPYC, while
torch's int4 kernel beats BLAS there only for a few rows. The plan is chosen once per
process from /proc/cpuinfo and printed by the benches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    cores: int

    @property
    def level(self) -> str:
        """The widest vector path: "amx", "avx512_bf16", "avx512", "avx2" or "baseline"."""
        for name, flag in (
            ("amx", "amx_bf16"),
            ("avx512_bf16", "avx512_bf16"),
            ("avx512", "avx512f"),
            ("avx2", "avx2"),
        ):
            if flag in self.flags:
                return name
        return "baseline"

    @property
    def native_bf16(self) -> bool:
        return self.level in ("amx", "avx512_bf16")


@dataclass(frozen=True)
class KernelPlan:
    """The storage and product of each kind of weight, and up to how many rows a step uses
    the quantized product before taking the dense path (where a dense copy exists)."""

    four_bit: str  # GGUF Q4_0 / Q4_1 / Q4_K
    other: str  # Q5_*, Q6_K, Q8_0, F16, BF16, F32 weights
    head: str  # the LM head (and Gemma's tied 262k-row embedding)
    threads: int

    def describe(self) -> dict[str, str]:
        return {
            "4-bit weights": self.four_bit,
            "other weights": self.other,
            "lm head": self.head,
            "threads": str(self.threads),
        }


@cache
def cpu_features() -> CpuFeatures:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:  # not Linux: assume the baseline
        pass
    return CpuFeatures(frozenset(flags), len(os.sched_getaffinity(0)))


def plan_for(features: CpuFeatures) -> KernelPlan:
    """int4 for the 4-bit types (an eighth of float32's bytes per step); bf16 for the other
    types: int8 per row there cost Gemma 3 (Q5_0/Q6_K/Q8_0 layers) teacher-forced top-1
    against the float32 reference, 96.6% vs 97.7% with bf16; int8 for the LM head where its
    rows allow it (torch_backend.MAX_INT8_ROW_ERROR), which is 2-4x faster than bf16 for one
    row on AVX2. The same on every CPU level today: measured only on AVX2 and AVX-512."""
    return KernelPlan(four_bit="int4", other="bf16", head="int8", threads=features.cores)
