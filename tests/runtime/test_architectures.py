"""Every committed architecture fixture (tests/fixtures/arch/, made by
tests/fixtures/make_arch_models.py: tiny transformers models converted and quantized by
llama.cpp itself) loaded through runtime.models.load_model on the default backend, against
llama.cpp's teacher-forced logits on the same file and transformers' float32 logits on the
same weights.

llama.cpp is the oracle within its own noise: each file's floor is how far llama.cpp's
logits on it are from its logits on the F16 file of the same weights (on the F16 file, from
transformers' float32), per position; where transformers' GGUF loader reads the
architecture, its float32 logits on each file's own dequantized weights say how much of that
is llama.cpp's activation rounding alone (the "exact floor"). A case whose architecture
runtime/models does not have yet is skipped, naming it.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.models import ARCHITECTURES, load_model
from tests.runtime.arch_cases import (
    ArchCase,
    against_llama_cpp,
    against_transformers,
    from_exact,
    has_exact_reference,
    llmq_logits,
    load_cases,
    manifest,
    position_floors,
)

CASES = load_cases()
# (b): |llmq - llama.cpp| at a position within FLOOR_MULTIPLE x that position's floor plus
# ABS_SLACK (llmq's own rounding: its dense kernels' fp16 activations moved F16 files'
# logits by up to 0.008, 1.5x llama.cpp's floor there)
FLOOR_MULTIPLE = 2.0
ABS_SLACK = 0.05
# (b, tighter): llmq's largest distance from exact float32 on the file's own weights, within
# EXACT_MULTIPLE x llama.cpp's plus ABS_SLACK (measured: at most 1.5x, Q2_K)
EXACT_MULTIPLE = 2.0
# (c): llmq on an F16 file against transformers' float32, relative to the largest logit
MAX_RELATIVE_TO_TRANSFORMERS = 1e-3
# OpenAI's gpt-oss and transformers (rope_scaling truncate: false) keep YaRN's correction
# dims fractional where llama.cpp rounds them to whole pairs (layers.Yarn.truncate): llmq
# runs llama.cpp's, which moves gpt-oss-F16's logits 0.037 from transformers' at the median
# and flips a router's choice at one position (7.1); (c) loads these with transformers'
UNTRUNCATED_YARN_IN_TRANSFORMERS = {"gpt-oss"}
# Files without transformers' exact reference (its GGUF loader fails on gpt-oss) whose
# floor, holding the experts' 4-bit quantization too (0.64 at the median), leaves fewer
# than a quarter of the positions decisive: float32 arithmetic on the file's own
# dequantized weights by llmq's numpy backend stands in for it (its arithmetic on the
# architecture is held to transformers' by the F16 case, (c))
NUMPY_EXACT = {"gpt-oss-MXFP4_MOE"}


def _supported(case: ArchCase) -> None:
    if case.architecture not in ARCHITECTURES:
        pytest.skip(f"architecture {case.architecture!r} is not in runtime.models yet")


@cache
def _ours(name: str, backend: str | None = None, yarn_truncate: bool = True) -> np.ndarray:
    case = next(c for c in CASES if c.name == name)
    return llmq_logits(case.gguf, case.arrays()["tokens"], backend, yarn_truncate)


def _exact_reference(case: ArchCase) -> dict[str, np.ndarray]:
    """The case's arrays with float32 arithmetic on its own weights (`exact_at_llama_ids`,
    `exact_floor`) from llmq's numpy backend where it stands in (NUMPY_EXACT)."""
    ref = case.arrays()
    if case.name in NUMPY_EXACT:
        exact = np.take_along_axis(_ours(case.name, "numpy"), ref["llama_ids"].astype(int), 1)
        ref["exact_at_llama_ids"] = exact
        ref["exact_floor"] = np.abs(ref["llama_logits"] - exact).max(axis=1)
    return ref


def _has_exact(case: ArchCase) -> bool:
    return has_exact_reference(case) or case.name in NUMPY_EXACT


def test_fixtures_hold_what_the_manifest_says():
    """Every file is there, of the recorded size, with the tensor types recorded from it."""
    import gguf

    cases = manifest()["cases"]
    assert len(CASES) >= 2 * len(cases)
    for case in CASES:
        entry = cases[case.model]["files"][case.qtype]
        assert case.gguf.stat().st_size == entry["bytes"], case.name
        reader = gguf.GGUFReader(str(case.gguf))
        types: dict[str, int] = {}
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        assert types == entry["tensor_types"], case.name
        arch = reader.fields["general.architecture"]
        assert bytes(arch.parts[arch.data[0]]).decode() == case.architecture


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_agrees_with_llama_cpp_on_its_own_file(case: ArchCase):
    """(a) llmq's top-1 is llama.cpp's wherever llama.cpp's top-2 margin exceeds the floor
    (ties are counted, not judged); (b) its logits are within a small multiple of the floor."""
    _supported(case)
    ref = _exact_reference(case)
    # llmq and llama.cpp read the same quantized weights: where llama.cpp's distance from
    # exact arithmetic on them is known, that (its activation rounding) decides what is
    # decisive, else the floor, which also holds the weights' quantization
    noise = position_floors(ref, "exact_floor" if _has_exact(case) else "floor")
    agreement = against_llama_cpp(_ours(case.name), ref, noise)
    print(f"{case.name}: {agreement.summary()} (floor max {case.floor:.4g})")
    assert agreement.decisive >= agreement.positions // 4, agreement.summary()
    assert not agreement.disagreements, (
        f"{case.name}: top-1 differs from llama.cpp at decisive positions "
        f"{agreement.disagreements}; {agreement.summary()}"
    )
    bound = FLOOR_MULTIPLE * position_floors(ref) + ABS_SLACK
    worst = int(np.argmax(agreement.errors - bound))
    assert agreement.errors[worst] <= bound[worst], (
        f"{case.name}: position {worst} is {agreement.errors[worst]:.4g} logits from "
        f"llama.cpp, its floor {ref['floor'][worst]:.4g}; {agreement.summary()}"
    )


@pytest.mark.parametrize("case", [c for c in CASES if _has_exact(c)], ids=lambda c: c.name)
def test_as_close_to_exact_arithmetic_as_llama_cpp(case: ArchCase):
    """(b, tighter) Against float32 arithmetic on the file's own dequantized weights
    (transformers, where its GGUF loader reads the architecture), llmq's logits are within
    a small multiple of llama.cpp's distance from them: its activation rounding alone,
    without the weights' quantization that the floor above also holds."""
    _supported(case)
    ref = _exact_reference(case)
    ours, llama = float(from_exact(_ours(case.name), ref).max()), float(ref["exact_floor"].max())
    print(f"{case.name}: from exact {ours:.4g}, llama.cpp {llama:.4g}")
    assert ours <= EXACT_MULTIPLE * llama + ABS_SLACK, (
        f"{case.name}: {ours:.4g} logits from exact float32 on the file's weights at worst, "
        f"llama.cpp {llama:.4g}"
    )


F16_CASES = [c for c in CASES if c.qtype == "F16"]


@pytest.mark.parametrize("case", F16_CASES, ids=lambda c: c.name)
def test_f16_file_equals_transformers_float32(case: ArchCase):
    """(c) The F16 file holds transformers' weights exactly (they were rounded to float16
    before the conversion), so llmq's logits are transformers' float32 ones."""
    _supported(case)
    truncate = case.architecture not in UNTRUNCATED_YARN_IN_TRANSFORMERS
    relative = against_transformers(_ours(case.name, yarn_truncate=truncate), case.arrays())
    print(f"{case.name}: max |llmq - transformers| / max |logit| = {relative:.3g}")
    assert relative <= MAX_RELATIVE_TO_TRANSFORMERS, f"{case.name}: {relative:.3g}"


# every fixture's architecture loads now: a file that names RWKV-7 (recurrent) stands in
UNSUPPORTED = sorted({c.architecture for c in F16_CASES} - set(ARCHITECTURES)) or ["rwkv7"]


@pytest.mark.parametrize("architecture", UNSUPPORTED)
def test_an_unsupported_architecture_is_refused_by_name(architecture: str):
    case = next((c for c in F16_CASES if c.architecture == architecture), F16_CASES[0])
    f = GGUFFile(case.gguf)
    f.metadata["general.architecture"] = architecture
    with pytest.raises(ModelFormatError, match=f"architecture '{architecture}' is not supported"):
        load_model(f)
