"""Which GGUF quant types a backend multiplies from their own codes, and how it keeps each.

A file of a type with no kernel from its codes still loads (gguf's dequantize reads every
type), but it is held dense at 3-8x its bytes and its speed: `llmq models` and the load log
name such types (`unmultiplied`), and `llmq models --supported` lists every type with its
kernel (`SUPPORTED`).
"""

from __future__ import annotations

import logging
from collections import Counter

import gguf

from runtime.kernels.gguf_blocks import (
    EIGHT_BIT_TYPES,
    FIVE_BIT_TYPES,
    FOUR_BIT_TYPES,
    TWO_BIT_TYPES,
    Q,
)

log = logging.getLogger("llmq.kernels")

DENSE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# how the CPU's row-invariant plan (runtime/kernels/cpu.py) multiplies each type
SUPPORTED: dict[Q, str] = {
    **{t: "its codes: lowbit_rows.c (4-bit, int8 activations)" for t in FOUR_BIT_TYPES},
    **{t: "its codes: lowbit_rows.c (5-bit, int8 activations)" for t in FIVE_BIT_TYPES},
    **{t: "its codes: int8_rows.c (int8 codes, int8 activations)" for t in EIGHT_BIT_TYPES},
    # 4-bit indices into the type's values (torch_backend.NibbleGroupWeight)
    **{
        t: "its codes: int8_rows.c (4-bit indices into its int8 values, int8 activations)"
        for t in (Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)
    },
    Q.Q2_K: "its codes and mins: int8_rows.c (4-bit indices, int8 activations)",
    **{t: "fp16 (dense: fbgemm; dense_rows.c on AVX2)" for t in (Q.F32, Q.F16, Q.BF16)},
}
CODE_TYPES = FOUR_BIT_TYPES | FIVE_BIT_TYPES | EIGHT_BIT_TYPES | TWO_BIT_TYPES


def tensor_types(f) -> Counter:
    """How many of the file's 2-D tensors (the weights a backend multiplies) hold each type."""
    return Counter(f.blocks(name)[1] for name in f.tensor_names() if len(f.blocks(name)[2]) == 2)


def kept_as(backend, qtype: Q) -> str:
    """How `backend` keeps and multiplies a weight of `qtype`, in a few words: the backend
    says (`describe_kept`, on the torch and device backends); numpy keeps float32."""
    describe = getattr(backend, "describe_kept", None)
    if describe is not None:
        return describe(qtype)
    return "float32" if qtype in DENSE_TYPES else "dequantized to float32"


def torch_kept_as(backend, qtype: Q) -> str:
    """`TorchBackend.describe_kept`: its codes through a native kernel, int4, or dense."""
    family = backend._family(qtype)
    if family == "lowbit":
        return "its codes (lowbit_rows.c)"
    if family:
        return "its codes (int8_rows.c)"
    if qtype in FOUR_BIT_TYPES and backend.plan.four_bit == "int4":
        return "int4 (torch)"
    dense = backend._dense_kind(backend.plan.other, 8)
    return dense if qtype in DENSE_TYPES else f"dequantized to {dense}"


def device_kept_as(backend, qtype: Q) -> str:
    """`DeviceBackend.describe_kept`: the CPU plan's answer, or what CUDA holds."""
    if backend.cpu is not None:
        return kept_as(backend.cpu, qtype)
    if qtype in FOUR_BIT_TYPES and backend.int4:
        return "int4 (CUDA)"
    return "dequantized to bf16 (CUDA)"


def unmultiplied(f, backend) -> list[Q]:
    """The file's weight types `backend` keeps dequantized where a kernel from their codes
    would be wanted: every quantized type but those it multiplies from their codes."""
    types = tensor_types(f)
    held = [t for t in types if t not in DENSE_TYPES and "dequantized" in kept_as(backend, t)]
    return sorted(held, key=lambda t: t.name)


def describe_types(f, backend) -> str:
    """One line: each weight type of the file, how many tensors hold it, how it is kept."""
    counts = tensor_types(f)
    return ", ".join(
        f"{t.name} x{counts[t]}: {kept_as(backend, t)}"
        for t in sorted(counts, key=lambda t: t.name)
    )


def log_types(f, backend) -> None:
    """The load log's account of the file's types; a warning naming those held dense."""
    log.info("%s: weight types %s", f.path.name, describe_types(f, backend))
    dense = unmultiplied(f, backend)
    if dense and backend.name != "numpy":
        log.warning(
            "%s: no kernel multiplies %s from its codes yet: held dequantized (several "
            "times the file's bytes)",
            f.path.name,
            ", ".join(t.name for t in dense),
        )


def supported_lines() -> list[str]:
    """`llmq models --supported`'s quant types: each with its kernel, then the rest."""
    lines = [f"  {t.name:<8} {SUPPORTED[t]}" for t in sorted(SUPPORTED, key=lambda t: t.value)]
    # the types gguf's numpy port can dequantize (it keeps them in a private table; the
    # block types with no port, and the activation-only Q8_1 / Q8_K, cannot be loaded)
    readable = getattr(gguf.quants, "_type_traits", {})
    rest = sorted(t.name for t in readable if t not in SUPPORTED)
    lines.append(
        f"  dequantized to fp16 at load (no kernel from their codes yet): {', '.join(rest)}"
    )
    return lines
