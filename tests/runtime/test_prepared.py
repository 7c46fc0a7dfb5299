"""Prepared weights kept in LLMQ_CACHE_DIR (runtime/kernels/prepared.py): a second load maps
what the first built, gives bitwise the same model, and rebuilds whatever the key says
changed or the file lost."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest

import runtime.cache_dir
from runtime.cache_dir import file_digest
from runtime.gguf_file import GGUFFile
from runtime.kernels import prepared
from runtime.kernels.cpu import CpuFeatures, fp16_plan, row_invariant_plan
from runtime.kernels.torch_backend import TorchBackend
from runtime.models import load_model
from runtime.models.base import BatchLayout, SequenceChunk
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama

Q = gguf.GGMLQuantizationType

PLANS = {
    "row-invariant": row_invariant_plan(CpuFeatures(frozenset({"avx2"}), 1)),
    "fp16": fp16_plan(1),
}
TOKENS = [1, 5, 9, 2, 7, 3, 11, 4]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(prepared.DISABLE_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=["llama-q4", "gemma3"])
def model_path(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("prepared")
    if request.param == "gemma3":
        return write_tiny_gemma3(folder / "tiny-gemma3.gguf")
    return write_tiny_llama(folder / "q4.gguf", layer_type=Q.Q4_1)


def _logits(model) -> np.ndarray:
    layout = BatchLayout([SequenceChunk(model.new_cache(len(TOKENS)), 0, len(TOKENS))])
    return model.logits(model.forward(np.asarray(TOKENS), layout))


def _saved_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "weights").glob("*.pt"))


def _forbid_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was built although an earlier load prepared it")

    monkeypatch.setattr(TorchBackend, "_build", refuse)
    monkeypatch.setattr(TorchBackend, "_build_head", refuse)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_second_load_maps_every_weight_and_answers_bitwise_alike(
    cache_dir, model_path, plan, monkeypatch
):
    built = load_model(GGUFFile(model_path), TorchBackend(PLANS[plan]))
    [saved] = _saved_files(cache_dir)
    written = saved.stat().st_ino  # a save renames a new file over it

    _forbid_building(monkeypatch)
    mapped = load_model(GGUFFile(model_path), TorchBackend(PLANS[plan]))

    assert saved.stat().st_ino == written  # nothing new to save
    assert [layer.wqkv.kind for layer in mapped.layers] == [
        layer.wqkv.kind for layer in built.layers
    ]
    np.testing.assert_array_equal(_logits(mapped), _logits(built))


def test_each_plan_keeps_its_own_weights(cache_dir, model_path):
    for plan in PLANS.values():
        load_model(GGUFFile(model_path), TorchBackend(plan))
    assert len(_saved_files(cache_dir)) == len(PLANS)


def test_a_changed_file_is_built_again(cache_dir, tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf", layer_type=Q.Q4_1)
    load_model(GGUFFile(path), TorchBackend(PLANS["row-invariant"]))
    before = _logits(load_model(GGUFFile(path), TorchBackend(PLANS["row-invariant"])))
    write_tiny_llama(path, layer_type=Q.Q4_1, seed=99)  # other weights, same path
    changed = load_model(GGUFFile(path), TorchBackend(PLANS["row-invariant"]))
    assert len(_saved_files(cache_dir)) == 2
    assert not np.array_equal(_logits(changed), before)


def test_a_damaged_file_is_rebuilt_with_a_warning(cache_dir, model_path, caplog):
    plan = PLANS["row-invariant"]
    expected = _logits(load_model(GGUFFile(model_path), TorchBackend(plan)))
    [saved] = _saved_files(cache_dir)
    saved.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])

    with caplog.at_level(logging.WARNING, logger=prepared.__name__):
        rebuilt = load_model(GGUFFile(model_path), TorchBackend(plan))

    assert "unreadable, rebuilding" in caplog.text
    np.testing.assert_array_equal(_logits(rebuilt), expected)
    assert prepared._read(saved)  # the rebuilt file reads back whole


def test_turned_off_nothing_is_written(cache_dir, model_path, monkeypatch):
    monkeypatch.setenv(prepared.DISABLE_ENV, "0")
    load_model(GGUFFile(model_path), TorchBackend(PLANS["fp16"]))
    assert _saved_files(cache_dir) == []


def test_a_failed_load_saves_nothing(cache_dir, model_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("head went wrong")

    monkeypatch.setattr(TorchBackend, "_build_head", fail)
    with pytest.raises(RuntimeError, match="head went wrong"):
        load_model(GGUFFile(model_path), TorchBackend(PLANS["fp16"]))
    assert _saved_files(cache_dir) == []


def test_file_digest_reads_a_file_once(cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"weights" * 1000)
    first = file_digest(path)

    def no_hashing(*args, **kwargs):
        raise AssertionError("the file was hashed again")

    with monkeypatch.context() as patched:
        patched.setattr(runtime.cache_dir.hashlib, "blake2b", no_hashing)
        assert file_digest(path) == first

    path.write_bytes(b"other" * 1000)  # a new size and mtime: hashed again
    assert file_digest(path) != first


@pytest.mark.slow
def test_real_smollm2_from_prepared_weights_answers_bitwise_alike(
    cache_dir, smollm2_gguf_path, monkeypatch
):
    """The real model on this CPU's own plan: mapped weights give the built ones' logits."""
    built = load_model(GGUFFile(smollm2_gguf_path), TorchBackend())
    _forbid_building(monkeypatch)
    mapped = load_model(GGUFFile(smollm2_gguf_path), TorchBackend())
    np.testing.assert_array_equal(_logits(mapped), _logits(built))


def test_the_folder_keeps_the_recently_loaded_within_its_size(cache_dir, model_path, monkeypatch):
    load_model(GGUFFile(model_path), TorchBackend(PLANS["fp16"]))
    [older] = _saved_files(cache_dir)
    monkeypatch.setattr(prepared, "MAX_FOLDER_BYTES", older.stat().st_size + 1)
    load_model(GGUFFile(model_path), TorchBackend(PLANS["row-invariant"]))
    [newer] = _saved_files(cache_dir)
    assert newer != older
