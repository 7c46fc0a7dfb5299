"""A thinking model's thinking through the Responses API, end to end: a real worker runs a
tiny model whose chat template thinks (Qwen3's shape, tests/workers/test_jobs.py), and the
response shows the thinking as a `reasoning` item before the message, in the stream and in
the final response, read with the official client.

The tiny random model is held to a thinking answer by a `regex`, as test_jobs.py holds it;
the Responses API has no such field, so the response is created as `POST /v1/responses`
creates it (its request translated, its record keeping the Responses request) with the
regex added to the chat request it runs. Everything after that is the user's path."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import gguf
import openai
import pytest

from api.flow import submit_request
from api.responses.requests import new_response_id, parse_response_request, translate
from runtime.hub import copy_metadata
from tests.api.conftest import worker_thread
from tests.tiny_models import write_tiny_llama
from tests.workers.test_jobs import THINKING_TEMPLATE
from workers import keys
from workers.wire.job import CHAT_COMPLETIONS

pytestmark = pytest.mark.integration

MODEL = "tiny-thinker"
THINKING, ANSWER = "[a-z]{4,12}\n", "[a-z]{2,8}"
REGEX = f"<think>\n{THINKING}</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with Qwen3's thinking template in place of its own."""
    folder = tmp_path_factory.mktemp("models")
    reader = gguf.GGUFReader(write_tiny_llama(folder / "plain.gguf"))
    target = folder / f"{MODEL}.gguf"
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer, skip=("tokenizer.chat_template",))
    writer.add_chat_template(THINKING_TEMPLATE)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return target


def test_the_thinking_is_a_reasoning_item_before_the_message_streamed_alike(
    live_app, server, redis_url, real_redis, thinker
) -> None:
    name = f"think-{uuid.uuid4().hex[:6]}"
    oai = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)
    with worker_thread(redis_url, real_redis, thinker, name), oai:
        body = {"model": MODEL, "input": "think", "max_output_tokens": 64, "temperature": 0}
        req = parse_response_request({**body, "background": True})
        response_id = new_response_id()
        translation = translate(req, response_id, [])
        chat = translation.chat.model_copy(update={"regex": REGEX})
        with live_app.test_request_context():
            submit_request(
                CHAT_COMPLETIONS, chat, job_id=response_id, responses=translation.stored.encode()
            )
        events = list(oai.responses.retrieve(response_id, stream=True))
        final = oai.responses.retrieve(response_id)

    assert final.status == "completed"
    reasoning, message = final.output
    assert (reasoning.type, message.type) == ("reasoning", "message")
    thinking = reasoning.content[0].text
    assert re.fullmatch(THINKING, thinking) and reasoning.summary == []
    assert re.fullmatch(ANSWER, final.output_text)  # the thinking is never in the answer
    # the chat result the worker wrote says the same
    result = json.loads(real_redis.hget(keys.job(response_id), "result"))
    chat_message = result["choices"][0]["message"]
    assert (chat_message["reasoning_content"], chat_message["content"]) == (
        thinking,
        final.output_text,
    )

    # the stream: the same items at the same indexes, the thinking in its own deltas
    kinds = [e.type for e in events]
    assert kinds[:3] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert kinds[-1] == "response.completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type, e.item.id) for e in added] == [
        (0, "reasoning", reasoning.id),
        (1, "message", message.id),
    ]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert {(e.item_id, e.output_index) for e in deltas} == {(reasoning.id, 0)}
    assert "".join(e.delta for e in deltas) == thinking
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == thinking
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert {e.output_index for e in texts} == {1}
    assert "".join(e.delta for e in texts) == final.output_text
    last = kinds.index("response.output_text.delta")
    assert max(i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta") < last
    assert events[-1].response.output == final.output
