"""Models named as `owner/repo[:QUANT]` (runtime/hub.py), fetched through huggingface_hub
from a hub on loopback: `HF_ENDPOINT` points it at a small server here that answers the
two calls a download makes (the repository's file list with sizes and SHA-256, and each
file), since no machine of this project reaches the real hub."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import huggingface_hub.constants
import numpy as np
import pytest

from runtime.errors import ModelNotFoundError
from runtime.gguf_file import GGUFFile
from runtime.hub import HubFile, HubReference, choose_files, copy_metadata, write_tensors
from runtime.models import load_model
from runtime.registry import load_registry, resolve
from tests.tiny_models import write_tiny_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def split_gguf(source: Path, shards: int, out: Path, stem: str) -> list[Path]:
    """`source` as llama.cpp's gguf-split lays a split model out: the metadata in the first
    shard, the tensors spread over all, `split.*` keys in each."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tensors = list(reader.tensors)
    per = -(-len(tensors) // shards)
    paths = []
    for n in range(shards):
        path = out / f"{stem}-{n + 1:05d}-of-{shards:05d}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        if n == 0:
            copy_metadata(reader, writer)
        writer.add_uint16("split.no", n)
        writer.add_uint16("split.count", shards)
        writer.add_int32("split.tensors.count", len(tensors))
        write_tensors(writer, [(reader, tensors[n * per : (n + 1) * per])])
        paths.append(path)
    return paths


class Hub:
    """A hub on loopback serving one repository's files; counts the downloads."""

    def __init__(self, repo: str, files: dict[str, Path]) -> None:
        self.repo, self.files, self.downloads = repo, files, 0
        self.corrupt: set[str] = set()  # files served with a byte flipped
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(body=True)

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?")[0]
                if path in (f"/api/models/{hub.repo}", f"/api/models/{hub.repo}/revision/main"):
                    return self._send(200, json.dumps(hub.info()).encode(), {}, body)
                if path.startswith("/api/models/"):  # as the hub answers for any other repo
                    return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
                prefix = f"/{hub.repo}/resolve/{COMMIT}/"
                name = path[len(prefix) :] if path.startswith(prefix) else None
                if name not in hub.files:
                    return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
                data = hub.files[name].read_bytes()
                if name in hub.corrupt:
                    data = data[:-1] + bytes([data[-1] ^ 1])
                if body:
                    hub.downloads += 1
                digest = hashlib.sha256(hub.files[name].read_bytes()).hexdigest()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{digest}"'}
                self._send(200, data, headers, body)

            def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def info(self) -> dict:
        siblings = []
        for name, path in self.files.items():
            data = path.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            siblings.append(
                {
                    "rfilename": name,
                    "size": len(data),
                    "lfs": {"sha256": sha, "size": len(data), "pointerSize": 134},
                }
            )
        return {"id": self.repo, "modelId": self.repo, "sha": COMMIT, "siblings": siblings}


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Iterator[Hub]:
    source = write_tiny_llama(tmp_path / "tiny.gguf")
    files = {"tiny-Q8_0.gguf": source, "mmproj-tiny-Q8_0.gguf": source}
    for shard in split_gguf(source, 3, tmp_path, "tiny-Q4_K_M"):
        files[shard.name] = shard
    (tmp_path / "README.md").write_text("tiny")
    files["README.md"] = tmp_path / "README.md"
    # huggingface_hub reads HF_HOME when imported; its cache is a constant read per call
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("LLMQ_CACHE_DIR", str(tmp_path / "llmq"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = Hub("someone/tiny-GGUF", files)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    yield hub
    hub.server.shutdown()
    hub.server.server_close()


def test_references_parse_as_llama_server_and_ollama_write_them():
    assert HubReference.parse("Qwen/Qwen3-1.7B-GGUF:Q4_K_M") == HubReference(
        "Qwen/Qwen3-1.7B-GGUF", "Q4_K_M"
    )
    assert HubReference.parse("hf.co/unsloth/gpt-oss-20b-GGUF") == HubReference(
        "unsloth/gpt-oss-20b-GGUF", None
    )
    assert HubReference.parse("models/tiny.gguf") is None
    assert HubReference.parse("smollm2-135m-instruct") is None


def test_the_quant_tag_picks_the_file_and_its_shards_in_order():
    files = [
        HubFile(name, 1, None)
        for name in (
            "m-Q8_0.gguf",
            "m-Q4_K_M-00002-of-00002.gguf",
            "m-Q4_K_M-00001-of-00002.gguf",
            "m-IQ4_XS.gguf",
            "mmproj-m-Q4_K_M.gguf",
        )
    ]
    pick = choose_files(HubReference("o/m", None), files)  # llama-server's default: Q4_K_M
    assert [f.name for f in pick] == [
        "m-Q4_K_M-00001-of-00002.gguf",
        "m-Q4_K_M-00002-of-00002.gguf",
    ]
    assert [f.name for f in choose_files(HubReference("o/m", "q8_0"), files)] == ["m-Q8_0.gguf"]
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file matches quant 'Q2_K'.*m-IQ4_XS"):
        choose_files(HubReference("o/m", "Q2_K"), files)


def test_a_hub_reference_is_fetched_once_checked_and_loads(hub, tmp_path):
    spec = resolve("someone/tiny-GGUF:Q8_0", registry={})
    path = spec.path()
    assert path.read_bytes() == hub.files["tiny-Q8_0.gguf"].read_bytes()
    assert load_model(GGUFFile(path)).architecture == "llama"
    assert resolve("someone/tiny-GGUF:Q8_0", registry={}).path() == path
    assert hub.downloads == 1  # the second resolve found it in the Hugging Face cache


def test_a_split_model_is_joined_into_one_file_equal_to_the_original(hub):
    joined = resolve("hf.co/someone/tiny-GGUF", registry={}).path()  # default Q4_K_M: shards
    assert hub.downloads == 3
    original, ours = gguf.GGUFReader(hub.files["tiny-Q8_0.gguf"]), gguf.GGUFReader(joined)
    assert [t.name for t in ours.tensors] == [t.name for t in original.tensors]
    for a, b in zip(original.tensors, ours.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name
    fields = {n: f.contents() for n, f in ours.fields.items() if not n.startswith("GGUF.")}
    expected = {n: f.contents() for n, f in original.fields.items() if not n.startswith("GGUF.")}
    assert fields == expected  # split.* keys gone, everything else kept


def test_a_file_whose_hash_differs_from_the_hubs_is_refused(hub):
    hub.corrupt.add("tiny-Q8_0.gguf")
    with pytest.raises(ModelNotFoundError, match="SHA-256 differs"):
        resolve("someone/tiny-GGUF:Q8_0", registry={}).path()


def test_offline_serves_what_was_fetched_and_says_what_to_do_otherwise(hub, monkeypatch):
    fetched = resolve("someone/tiny-GGUF:Q8_0", registry={}).path()
    hub.server.shutdown()
    hub.server.server_close()  # the hub is gone: nothing listens there any more
    assert resolve("someone/tiny-GGUF:Q8_0", registry={}).path() == fetched
    with pytest.raises(ModelNotFoundError, match="cannot be reached.*HF_ENDPOINT"):
        resolve("someone/tiny-GGUF:IQ4_XS", registry={}).path()


def test_an_unknown_repository_says_so(hub):
    with pytest.raises(ModelNotFoundError, match="no repository 'someone/other'"):
        resolve("someone/other:Q8_0", registry={}).path()


def test_a_registry_entry_may_name_a_hub_reference(hub, tmp_path):
    toml = tmp_path / "models.toml"
    toml.write_text('[models.tiny]\nhub = "someone/tiny-GGUF:Q8_0"\n')
    spec = load_registry(toml)["tiny"]
    assert spec.source == "hub someone/tiny-GGUF:Q8_0"
    assert spec.path().read_bytes() == hub.files["tiny-Q8_0.gguf"].read_bytes()
