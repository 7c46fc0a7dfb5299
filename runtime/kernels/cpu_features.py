"""What this CPU can do: its flags from /proc/cpuinfo and the cores this process may use.

Its own module so that the native kernels' builds (runtime/kernels/native.py, keyed by these
flags) and the kernel plan (runtime/kernels/cpu.py, which asks whether those kernels build)
both read it without importing each other.
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
