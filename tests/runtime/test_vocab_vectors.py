"""Our tokenizer against llama.cpp's own tokenizer test vectors, all of them.

llama.cpp's source carries, per vocabulary family, a vocab-only GGUF
(`models/ggml-vocab-<name>.gguf`), the test texts (`.inp`, separated by
`\\n__ggml_vocab_test__\\n`) and the ids its tokenizer gives them (`.out`, one line per
text), as its `tests/test-tokenizer-0.cpp` reads them: `common_tokenize(ctx, text,
add_special=false, parse_special=false)`. `make test` unpacks them from the llama-cpp-python
sdist the bench extra pins (the Makefile's `LLAMA_MODELS`). BERT's WordPiece vocabulary is
an embedding model's, refused by name (tested below).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import UnsupportedTokenizerError
from runtime.gguf_header import GGUFHeader
from runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB_DIR = Path(
    os.environ.get(
        "LLMQ_LLAMA_VOCABS",
        ROOT / "build/llama-cpp-python-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models",
    )
)
SEPARATOR = "\n__ggml_vocab_test__\n"
REFUSED = {"bert-bge"}  # WordPiece: embedding models' vocabulary, not served
# every family whose vectors llama.cpp 0.3.36's source ships; a missing one fails
FAMILIES = sorted(
    {"command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe"}
    | {"llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"}
)


def _vectors(family: str) -> tuple[Path, list[tuple[str, list[int]]]]:
    vocab = VOCAB_DIR / f"ggml-vocab-{family}.gguf"
    if not vocab.is_file():
        message = f"{vocab} is missing: `make test` unpacks llama.cpp's vocab files"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    raw = Path(f"{vocab}.inp").read_text(encoding="utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):  # as test-tokenizer-0.cpp splits: no empty last text
        texts.pop()
    expected = Path(f"{vocab}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(expected), f"{vocab}: .inp and .out hold different counts"
    ids = [[int(i) for i in line.split()] for line in expected]
    return vocab, list(zip(texts, ids, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_vector_of_the_family_tokenizes_as_llama_cpp_does(family):
    vocab, cases = _vectors(family)
    tokenizer = Tokenizer.from_metadata(GGUFHeader(vocab).metadata)
    wrong = [
        (text, ids, got)
        for text, ids in cases
        if (got := tokenizer.encode(text, add_special=False, parse_special=False)) != ids
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ; first: {wrong[0]!r}"


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_an_embedding_vocabulary_is_refused_by_name(family):
    vocab, _ = _vectors(family)
    with pytest.raises(UnsupportedTokenizerError, match="'bert'"):
        Tokenizer.from_metadata(GGUFHeader(vocab).metadata)


def test_the_vectors_cover_every_family_llama_cpp_ships():
    if not VOCAB_DIR.is_dir():
        pytest.skip(f"{VOCAB_DIR} is missing")
    shipped = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in VOCAB_DIR.glob("*.inp")}
    assert shipped == set(FAMILIES) | REFUSED
