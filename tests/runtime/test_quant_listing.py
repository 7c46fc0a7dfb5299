"""Which quant types llmq multiplies from their codes, as a user sees it: `llmq models`
names each model's types and how each is kept (and those no kernel takes yet), `llmq
models --supported` lists the architectures and every type's kernel, and a load logs the
same (runtime/kernels/quant_types.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from runtime.gguf_file import GGUFFile
from runtime.kernels.cpu import row_invariant_plan
from runtime.kernels.cpu_features import cpu_features
from runtime.kernels.native import int8_rows, lowbit_builds
from runtime.kernels.torch_backend import TorchBackend
from runtime.models import ARCHITECTURES, load_model

LLMQ = Path(sys.executable).with_name("llmq")
ARCH = Path(__file__).parents[1] / "fixtures" / "arch"
Q = gguf.GGMLQuantizationType
NEW_TYPES = ("Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "MXFP4")
needs_kernels = pytest.mark.skipif(
    int8_rows() is None or not lowbit_builds(), reason="no C compiler for the kernels"
)


def _iq2_file(path: Path) -> Path:
    """A llama-named file whose one layer weight is IQ2_XXS (random codes, a sane factor)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((64, 256)).astype(np.float32)
    writer.add_tensor(
        "token_embd.weight", gguf.quants.quantize(embedding, Q.Q8_0), raw_dtype=Q.Q8_0
    )
    raw = rng.integers(0, 256, (256, 66), dtype=np.uint8)
    raw[:, :2] = np.array([1e-3], np.float16).view(np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=Q.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _models(registry: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMQ_MODELS": str(registry)}
    command = [str(LLMQ), "models", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def test_supported_lists_the_architectures_and_every_types_kernel():
    result = subprocess.run(
        [str(LLMQ), "models", "--supported"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "architectures: " + ", ".join(sorted(ARCHITECTURES))
    kernels = {line.split()[0]: line for line in lines[2:] if line.startswith("  ")}
    for name in (*NEW_TYPES, "Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0"):
        assert "its codes" in kernels[name], name
    assert "fp16" in kernels["F16"] and "fp16" in kernels["BF16"]
    rest = next(line for line in lines if "no kernel from their codes" in line)
    for name in ("IQ2_XXS", "IQ3_S", "TQ1_0"):
        assert name in rest
    assert "Q5_K" not in rest


@needs_kernels
def test_models_names_each_type_and_those_held_dequantized(tmp_path):
    registry = tmp_path / "models.toml"
    q2 = ARCH / "llama-q-Q2_K.gguf"
    iq2 = _iq2_file(tmp_path / "iq2.gguf")
    registry.write_text(
        f'[models.q2]\npath = "{q2}"\nbackend = "torch"\n'
        f'[models.iq2]\npath = "{iq2}"\nbackend = "torch"\n'
    )
    result = _models(registry)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    q2_types = lines[lines.index(next(x for x in lines if x.startswith("q2 "))) + 1]
    assert "Q2_K x4: its codes (int8_rows.c)" in q2_types
    assert "Q3_K x2: its codes (int8_rows.c)" in q2_types
    assert "Q4_K x1: its codes (lowbit_rows.c)" in q2_types
    iq2_at = lines.index(next(x for x in lines if x.startswith("iq2 ")))
    assert "IQ2_XXS x1: dequantized to" in lines[iq2_at + 1]
    assert lines[iq2_at + 2].strip() == "not multiplied from their codes yet: IQ2_XXS"
    assert not any("not multiplied" in line for line in lines[: iq2_at + 1])


@needs_kernels
@pytest.mark.parametrize("quant", ["Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL"])
def test_a_load_keeps_every_layer_weight_as_its_codes(quant, caplog):
    """Loading llama.cpp's own quantizations of a tiny llama: the log names every type with
    its kernel and warns of none, and no layer weight is held dense."""
    f = GGUFFile(ARCH / f"llama-q-{quant}.gguf")
    backend = TorchBackend(row_invariant_plan(cpu_features()))
    with caplog.at_level(logging.INFO, logger="llmq.kernels"):
        model = load_model(f, backend)
    info = [r.getMessage() for r in caplog.records if "weight types" in r.getMessage()]
    assert len(info) == 1 and "dequantized" not in info[0], info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    kinds = {type(w).__name__ for w in _layer_weights(model)}
    assert kinds and not kinds & {"Fp16Weight", "Fp16RowsWeight", "Bf16Weight"}, kinds


def _layer_weights(model) -> list:
    """Every layer's weights, a fused weight of mixed types (StackedWeight) as its parts."""
    found = []
    for layer in model.layers:
        for weight in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
            found.extend(getattr(weight, "parts", [weight]))
    return found


def test_a_type_no_kernel_takes_is_named_in_the_load_log(tmp_path, caplog):
    from runtime.kernels.quant_types import log_types

    f = GGUFFile(_iq2_file(tmp_path / "iq2.gguf"))
    with caplog.at_level(logging.INFO, logger="llmq.kernels"):
        log_types(f, TorchBackend(row_invariant_plan(cpu_features())))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "IQ2_XXS" in warnings[0] and "Q8_0" not in warnings[0]


@needs_kernels
@pytest.mark.parametrize("quant", ["Q3_K_M", "Q2_K", "IQ4_XS"])
def test_a_second_load_maps_the_same_weights_and_answers_bitwise_alike(
    quant, tmp_path, monkeypatch
):
    """The prepared store (runtime/kernels/prepared.py) restores the new kinds (4-bit
    indices and their table, Q2_K's codes and mins) as they were built."""
    from runtime.kernels import prepared
    from runtime.models.base import BatchLayout, SequenceChunk

    monkeypatch.setenv("LLMQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(prepared.DISABLE_ENV, raising=False)
    path, tokens = ARCH / f"llama-q-{quant}.gguf", np.array([1, 5, 9, 2, 7, 3, 11, 4])

    def logits(model) -> np.ndarray:
        layout = BatchLayout([SequenceChunk(model.new_cache(len(tokens)), 0, len(tokens))])
        return model.logits(model.forward(tokens, layout))

    plan = row_invariant_plan(cpu_features())
    built = load_model(GGUFFile(path), TorchBackend(plan))
    monkeypatch.setattr(TorchBackend, "_build", None)  # a second build would fail
    mapped = load_model(GGUFFile(path), TorchBackend(plan))
    kinds = [w.kind for w in _layer_weights(mapped)]
    assert kinds == [w.kind for w in _layer_weights(built)]
    np.testing.assert_array_equal(logits(mapped), logits(built))
