"""Result bodies are built through the models `/openapi.json` documents, and come out as
the plain JSON objects the `done` event and the API always carried."""

from __future__ import annotations

import numpy as np

from api.bodies import ChatCompletion as DocumentedChatCompletion
from workers.result_bodies import ChoiceOutput, chat_body, completion_body, embeddings_body, usage
from workers.wire.bodies import ChatCompletion, Completion, EmbeddingList


def test_the_documented_models_are_the_ones_the_worker_builds_with():
    assert DocumentedChatCompletion is ChatCompletion


def test_bodies_validate_against_their_models_and_leave_unset_fields_out():
    plain = ChoiceOutput(0, text=["a", "b"], tokens=2, finish_reason="stop")
    calls = ChoiceOutput(
        1, tokens=1, finish_reason="tool_calls", parsed=True, tool_calls=[{"id": "c"}]
    )
    chat = chat_body("j", 1.5, "m", [plain, calls], 3, False, cached_tokens=1)
    assert ChatCompletion.model_validate(chat).dump() == chat
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert chat["choices"][1]["message"]["content"] is None
    assert chat["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    completion = completion_body("j", 1.5, "m", [plain], 3, False)
    assert Completion.model_validate(completion).dump() == completion
    vectors = embeddings_body("m", np.ones((2, 3), dtype=np.float32), 4, None)
    assert EmbeddingList.model_validate(vectors).dump() == vectors
    assert vectors["usage"] == usage(4) == {"prompt_tokens": 4, "total_tokens": 4}
