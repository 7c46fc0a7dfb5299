"""The fast header reader gives what gguf-py's reader gives, on both real model files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from runtime.gguf_header import GGUFHeader


def _reference(path):
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, {t.name: t for t in reader.tensors}


@pytest.mark.slow
@pytest.mark.parametrize("model_path", ["smollm2_gguf_path", "gemma3_gguf_path"])
def test_header_matches_gguf_reader(model_path, request):
    path = request.getfixturevalue(model_path)
    header = GGUFHeader(path)
    metadata, tensors = _reference(path)
    assert header.metadata == metadata
    assert header.tensors.keys() == tensors.keys()
    for name, info in header.tensors.items():
        ref = tensors[name]
        assert info.tensor_type == ref.tensor_type
        assert info.shape == tuple(int(n) for n in reversed(ref.shape))
        assert info.data.shape == ref.data.shape and info.data.dtype == ref.data.dtype
        np.testing.assert_array_equal(info.data, ref.data)


def test_tiny_model_header_matches_gguf_reader(tiny_llama_path):
    header = GGUFHeader(tiny_llama_path)
    metadata, tensors = _reference(tiny_llama_path)
    assert header.metadata == metadata
    for name, info in header.tensors.items():
        np.testing.assert_array_equal(info.data, tensors[name].data)
