"""Models named as people name them on a hub: `owner/repo[:QUANT]`.

`llama-server -hf owner/repo:Q4_K_M` and `ollama run hf.co/owner/repo:Q4_K_M` take a
repository and a quant tag; so does every place llmq takes a model id. The repository's
file list (with each LFS file's size and SHA-256) comes from the hub's API through
`huggingface_hub`, which also downloads into its own cache (`HF_HOME`) with a progress bar
and honours `HF_ENDPOINT` (a mirror, or the local server of tests/runtime/test_hub.py).
Each file is checked by size and hash once (runtime/cache_dir.py `file_digest` remembers
it); a model split into `-0000N-of-0000M.gguf` shards is joined into one GGUF under
llmq's cache, since the loader reads one file. What a reference resolved to is recorded
there too, so that a machine without the hub (`HF_HUB_OFFLINE=1`, or no network) serves
what it fetched before, and says what to do when it has nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import gguf

from runtime.cache_dir import cache_dir, file_digest, write_atomically
from runtime.errors import ModelNotFoundError

log = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # what llama-server -hf takes when the reference names none
HUB_PREFIXES = ("https://huggingface.co/", "huggingface.co/", "hf.co/", "hf://")
_REFERENCE = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+))?")
_SPLIT = re.compile(r"-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class HubReference:
    """A repository and the quant tag its GGUF file names carry (`Q4_K_M`, `q8_0`, ...)."""

    repo: str
    quant: str | None

    @classmethod
    def parse(cls, text: str) -> HubReference | None:
        """The reference `text` names, or None where it is no hub reference (a path)."""
        for prefix in HUB_PREFIXES:
            if text.startswith(prefix):
                text = text[len(prefix) :]
                break
        match = _REFERENCE.fullmatch(text)
        if match is None or text.endswith(".gguf"):
            return None
        return cls(match["repo"], match["quant"])

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


@dataclass(frozen=True)
class HubFile:
    """One file of the repository, as its API lists it."""

    name: str
    size: int | None
    sha256: str | None


def choose_files(reference: HubReference, files: list[HubFile]) -> list[HubFile]:
    """The GGUF file (or the shards of one, in order) that `reference` names: the one whose
    name carries its quant tag (DEFAULT_QUANT when it names none, else the only GGUF there
    is). Projector files (`mmproj`) are never the model."""
    ggufs = [f for f in files if f.name.endswith(".gguf") and "mmproj" not in f.name.lower()]
    if not ggufs:
        raise ModelNotFoundError(f"{reference.repo} holds no GGUF file")
    quant = reference.quant or DEFAULT_QUANT
    tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9])", re.IGNORECASE)
    chosen = [f for f in ggufs if tag.search(f.name.rsplit("/", 1)[-1])]
    if not chosen and reference.quant is None and len({_stem(f.name) for f in ggufs}) == 1:
        chosen = ggufs
    stems = sorted({_stem(f.name) for f in chosen})
    if not chosen or len(stems) > 1:
        available = ", ".join(sorted({_stem(f.name) for f in ggufs}))
        what = "no GGUF file" if not chosen else "more than one GGUF file"
        raise ModelNotFoundError(
            f"{reference.repo}: {what} matches quant {quant!r}; its GGUF files: {available} "
            f"(name one as {reference.repo}:QUANT)"
        )
    return sorted(chosen, key=lambda f: f.name)


def _stem(name: str) -> str:
    """A file's name without its shard suffix: the shards of one model share it."""
    return _SPLIT.sub("", name).removesuffix(".gguf")


def fetch(reference: HubReference, endpoint: str | None = None) -> Path:
    """The local GGUF of `reference`: downloaded once, checked, shards joined. Offline, what
    an earlier fetch recorded."""
    record = cache_dir() / "hub" / (re.sub(r"[^\w.-]", "--", str(reference)) + ".json")
    try:
        path = _fetch_online(reference, endpoint or os.environ.get("HF_ENDPOINT"))
    except _HubUnreachable as exc:
        return _fetched_before(reference, record, exc)
    write_atomically(record, lambda target: target.write_text(json.dumps({"path": str(path)})))
    return path


class _HubUnreachable(Exception):
    """The hub could not be asked (offline mode, no network, the endpoint down)."""


def _fetch_online(reference: HubReference, endpoint: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled, RepositoryNotFoundError

    api = huggingface_hub.HfApi(endpoint=endpoint)
    try:
        info = api.model_info(reference.repo, files_metadata=True)
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"no repository {reference.repo!r} on the hub") from exc
    except (OfflineModeIsEnabled, _transport_error()) as exc:
        raise _HubUnreachable(str(exc) or type(exc).__name__) from exc
    listed = [
        HubFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings or []
    ]
    chosen = choose_files(reference, listed)
    paths = []
    for file in chosen:
        log.info("fetching %s/%s (%s bytes)", reference.repo, file.name, file.size)
        local = Path(
            huggingface_hub.hf_hub_download(
                reference.repo, file.name, revision=info.sha, endpoint=endpoint
            )
        )
        _check(local, file, reference)
        paths.append(local)
    if len(paths) == 1:
        return paths[0]
    target = cache_dir() / "models" / "hub" / f"{_stem(chosen[0].name).replace('/', '--')}.gguf"
    if not target.is_file():
        log.info("joining %d shards of %s into %s", len(paths), reference, target)
        write_atomically(target, lambda partial: join_shards(paths, partial))
    return target


def _transport_error() -> type[Exception]:
    """The HTTP client's "no answer" error: huggingface_hub 2 speaks httpx2, 1.x httpx."""
    try:
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError
    return TransportError


def _check(path: Path, file: HubFile, reference: HubReference) -> None:
    """The downloaded file is the one the hub lists: its size and, for an LFS file, its
    SHA-256 (hashed once: cache_dir.file_digest remembers it)."""
    size = path.stat().st_size
    if file.size is not None and size != file.size:
        raise ModelNotFoundError(
            f"{reference.repo}/{file.name}: {size} bytes downloaded, the hub lists {file.size}; "
            "delete it from the Hugging Face cache and fetch again"
        )
    if file.sha256 is not None and file_digest(path, "sha256") != file.sha256:
        raise ModelNotFoundError(
            f"{reference.repo}/{file.name}: SHA-256 differs from the hub's {file.sha256}; "
            "delete it from the Hugging Face cache and fetch again"
        )


def _fetched_before(reference: HubReference, record: Path, why: _HubUnreachable) -> Path:
    try:
        path = Path(json.loads(record.read_text())["path"])
    except (OSError, ValueError, KeyError):
        path = None
    if path is not None and path.is_file():
        log.info("hub unreachable (%s); using %s fetched before", why, path)
        return path
    raise ModelNotFoundError(
        f"{reference} is not on this machine and the hub cannot be reached ({why}). "
        "Fetch it once where the hub is reachable (the same command, or `hf download "
        f"{reference.repo}` and copy the Hugging Face cache), set HF_ENDPOINT to a mirror, "
        "or pass the path of a .gguf file as the model"
    )


def join_shards(shards: list[Path], target: Path) -> None:
    """One GGUF from the shards of a split model (llama.cpp's gguf-split layout: the first
    shard holds the metadata, each holds some tensors and `split.*` keys)."""
    readers = [gguf.GGUFReader(path) for path in shards]
    first = readers[0]
    writer = gguf.GGUFWriter(str(target), first.fields["general.architecture"].contents())
    copy_metadata(first, writer, skip=("split.",))
    write_tensors(writer, [(reader, list(reader.tensors)) for reader in readers])


def write_tensors(
    writer: gguf.GGUFWriter, parts: list[tuple[gguf.GGUFReader, list[gguf.ReaderTensor]]]
) -> None:
    """Finish `writer` (its keys added): the tensors of each part (a reader and some of its
    tensors) in order, as each reader holds them; closes it."""
    for _, tensors in parts:
        for t in tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for reader, tensors in parts:
        for t in tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, skip: tuple = ()) -> None:
    """Every key of `reader` into `writer` but the architecture (the writer was made with
    it), the reader's own `GGUF.*` fields and the keys starting with `skip`."""
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", *skip)) or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
