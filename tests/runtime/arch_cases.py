"""The committed architecture fixtures (tests/fixtures/arch/, made by
tests/fixtures/make_arch_models.py) as cases, and the measures the tests hold them to.

Each case is one GGUF file: an architecture's F16 conversion or a llama.cpp quantization of
it, with llama.cpp's teacher-forced top ids and logits on it, transformers' float32 ones on
the same weights, and the file's floor (how far llama.cpp's own logits on it are from its
logits on the F16 file; on the F16 file, from transformers' float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

ARCH_DIR = Path(__file__).parents[1] / "fixtures" / "arch"
MANIFEST = ARCH_DIR / "manifest.json"


@dataclass(frozen=True)
class ArchCase:
    model: str  # the manifest's case name: "qwen3", "llama-q", ...
    qtype: str  # "F16", "Q8_0", "Q4_K_M", ...
    architecture: str  # GGUF general.architecture
    gguf: Path
    reference: Path
    floor: float
    tensor_types: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        return f"{self.model}-{self.qtype}"

    def arrays(self) -> dict[str, np.ndarray]:
        with np.load(self.reference) as data:
            return {k: data[k] for k in data.files}


@cache
def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def load_cases() -> list[ArchCase]:
    """Every committed file, in the manifest's order."""
    cases = []
    for model, entry in manifest()["cases"].items():
        for qtype, f in entry["files"].items():
            cases.append(
                ArchCase(
                    model=model,
                    qtype=qtype,
                    architecture=entry["architecture"],
                    gguf=ARCH_DIR / f["gguf"],
                    reference=ARCH_DIR / f["reference"],
                    floor=f["floor"],
                    tensor_types=tuple(sorted(f["tensor_types"].items())),
                )
            )
    return cases


def llmq_logits(
    path: Path, tokens: np.ndarray, backend: str | None = None, yarn_truncate: bool = True
) -> np.ndarray:
    """llmq's teacher-forced logits `[n, V]` over `tokens` in one forward pass, the model
    loaded as a user's would be (runtime.models.load_model, the default backend), every row
    at the file's precision (`exact`: the rows a user sees or samples from; a greedy row
    may take a cheaper int8 head, runtime/kernels/torch_backend.py). `yarn_truncate`
    False: YaRN's correction dims kept fractional, as transformers' gpt-oss keeps them
    (runtime/models/layers.py `Yarn.truncate`; llmq rounds them as llama.cpp does)."""
    from runtime.gguf_file import GGUFFile
    from runtime.kernels import get_backend
    from runtime.models import load_model
    from runtime.models.base import BatchLayout, SequenceChunk

    model = load_model(GGUFFile(path), get_backend(backend))
    if not yarn_truncate and model.args.yarn is not None:
        model.args.yarn.truncate = False
        model.ropes = model.rope_freqs(GGUFFile(path))
    cache_ = model.new_cache(len(tokens))
    layout = BatchLayout([SequenceChunk(cache_, 0, len(tokens))])
    hidden = model.forward(np.asarray(tokens), layout)
    return model.ops.to_host(model.logits(hidden, exact=True))


@dataclass(frozen=True, eq=False)
class Agreement:
    """llmq against llama.cpp on one file."""

    positions: int
    decisive: int  # llama.cpp's top-1 minus top-2 margin above the file's floor
    agreed: int  # of the decisive positions, where llmq's top-1 is llama.cpp's
    ties: int  # positions whose margin is within the floor (not counted either way)
    ties_agreed: int
    max_error: float  # max |llmq - llama.cpp| over llama.cpp's top ids at every position
    disagreements: tuple[int, ...]
    errors: np.ndarray  # [n]: max |llmq - llama.cpp| over llama.cpp's top ids, per position

    def summary(self) -> str:
        return (
            f"top-1 {self.agreed}/{self.decisive} decisive, ties {self.ties_agreed}/{self.ties}"
            f", max error {self.max_error:.4g}"
        )


def position_floors(ref: dict[str, np.ndarray], key: str = "floor") -> np.ndarray:
    """The file's floor at each position, never below its median: llama.cpp's quantized
    logits moved by its own rounding, or where one MoE router's choice flipped (gpt-oss's
    F16 file: 7.1 logits at one position, 0.04 at the median), by that flip. `key`
    "exact_floor": llama.cpp against exact float32 arithmetic on the file's own weights."""
    floors = ref[key]
    return np.maximum(floors, np.median(floors))


def has_exact_reference(case: ArchCase) -> bool:
    """Whether transformers' float32 logits on this file's own dequantized weights exist
    (its GGUF loader reads the architecture right; every F16 file has them)."""
    return "exact_floor" in manifest()["cases"][case.model]["files"][case.qtype]


def from_exact(ours: np.ndarray, ref: dict[str, np.ndarray]) -> np.ndarray:
    """`[n]`: max |llmq - exact float32 on the file's weights| over llama.cpp's top ids."""
    ids = ref["llama_ids"].astype(np.int64)
    return np.abs(np.take_along_axis(ours, ids, axis=1) - ref["exact_at_llama_ids"]).max(axis=1)


def against_llama_cpp(
    ours: np.ndarray, ref: dict[str, np.ndarray], floors: np.ndarray
) -> Agreement:
    """`floors` `[n]`: the margin above which llama.cpp's choice counts as decisive."""
    ids, vals = ref["llama_ids"].astype(np.int64), ref["llama_logits"]
    margin = vals[:, 0] - vals[:, 1]
    decisive = margin > floors
    same = ours.argmax(axis=1) == ids[:, 0]
    error = np.abs(np.take_along_axis(ours, ids, axis=1) - vals).max(axis=1)
    return Agreement(
        positions=len(ids),
        decisive=int(decisive.sum()),
        agreed=int((same & decisive).sum()),
        ties=int((~decisive).sum()),
        ties_agreed=int((same & ~decisive).sum()),
        max_error=float(error.max()),
        disagreements=tuple(np.flatnonzero(decisive & ~same).tolist()),
        errors=error,
    )


def against_transformers(ours: np.ndarray, ref: dict[str, np.ndarray]) -> float:
    """max |llmq - transformers| over transformers' and llama.cpp's top ids, relative to
    the largest transformers logit there."""
    worst, scale = 0.0, 0.0
    for ids_key, vals_key in (("hf_ids", "hf_logits"), ("llama_ids", "hf_at_llama_ids")):
        ids, vals = ref[ids_key].astype(np.int64), ref[vals_key]
        worst = max(worst, float(np.abs(np.take_along_axis(ours, ids, axis=1) - vals).max()))
        scale = max(scale, float(np.abs(vals).max()))
    return worst / scale
