"""Golden tokenization: our ids against llama.cpp's and transformers' for the shipped models.

The references are `tests/fixtures/reference/<model_id>.json`, made by
`tests/fixtures/make_references.py` with llama-cpp-python and transformers. llama.cpp is
the contract: every case and every prompt must match it exactly. Where transformers gives
different ids than llama.cpp we cannot match both; those cases are strict xfails, so they
start failing if we ever drift from llama.cpp towards transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REFERENCE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "reference"
MODELS = {
    "smollm2-135m-instruct": ("smollm2_tokenizer", []),
    "gemma-3-270m": ("gemma3_tokenizer", [pytest.mark.slow]),
}


def _load(model_id: str) -> dict[str, Any] | None:
    path = REFERENCE_DIR / f"{model_id}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


DISAGREE = "transformers and llama.cpp disagree here; llmq follows llama.cpp"


def _params(kind: str, versus_transformers: bool = False) -> list[Any]:
    """One pytest param per case or prompt of every model whose reference file exists."""
    params = []
    for model_id, (fixture, marks) in MODELS.items():
        doc = _load(model_id)
        for i, item in enumerate(doc[kind] if doc else []):
            case_marks = list(marks)
            if versus_transformers:
                if item["transformers"] is None:
                    continue
                if item["transformers"] != item["llama_cpp"]:
                    case_marks.append(pytest.mark.xfail(strict=True, reason=DISAGREE))
            params.append(pytest.param(fixture, item, id=f"{model_id}-{i}", marks=case_marks))
    return params


@pytest.mark.parametrize("model_id", list(MODELS))
def test_reference_fixture_is_present(model_id):
    doc = _load(model_id)
    assert doc is not None, f"missing {REFERENCE_DIR / model_id}.json (make_references.py)"
    assert doc["tokenizer_cases"] and doc["prompts"]


@pytest.mark.parametrize(("fixture", "case"), _params("tokenizer_cases"))
def test_encode_matches_llama_cpp(request, fixture, case):
    tok = request.getfixturevalue(fixture)
    ids = tok.encode(case["text"], case["add_special"], case["parse_special"])
    assert ids == case["llama_cpp"]


@pytest.mark.parametrize(("fixture", "case"), _params("tokenizer_cases", versus_transformers=True))
def test_encode_matches_transformers(request, fixture, case):
    tok = request.getfixturevalue(fixture)
    ids = tok.encode(case["text"], case["add_special"], case["parse_special"])
    assert ids == case["transformers"]


@pytest.mark.parametrize(("fixture", "prompt"), _params("prompts"))
def test_prompt_ids_match_llama_cpp(request, fixture, prompt):
    tok = request.getfixturevalue(fixture)
    assert tok.encode(prompt["text"], add_special=True, parse_special=True) == prompt["token_ids"]


@pytest.mark.parametrize(("fixture", "case"), _params("tokenizer_cases"))
def test_decode_round_trips(request, fixture, case):
    tok = request.getfixturevalue(fixture)
    ids = case["llama_cpp"]
    bos = tok.token_text(tok.bos_id) if case["add_special"] and tok.add_bos else ""
    eos = tok.token_text(tok.eos_id) if case["add_special"] and tok.add_eos else ""
    # with special tokens rendered, every byte of the text comes back (neither model
    # adds a space prefix, so nothing is lost)
    assert tok.decode(ids, skip_special=False) == bos + case["text"] + eos
    if not any(tok.is_special(i) for i in ids):
        assert tok.decode(ids) == case["text"]
