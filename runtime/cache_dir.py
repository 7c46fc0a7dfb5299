"""Where llmq keeps what it builds once per machine and reuses: Gemma's GGUF joined from
its part packages (runtime/registry.py), the compiled attention kernel
(runtime/kernels/native.py) and prepared weights (runtime/kernels/prepared.py); and how
what it keeps there is named and written."""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "LLMQ_CACHE_DIR"
DIGEST_CHUNK = 16 << 20


def cache_dir() -> Path:
    """`LLMQ_CACHE_DIR`, else ~/.cache/llmq."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llmq")


def file_digest(path: Path, algorithm: str = "blake2b") -> str:
    """The hex digest of the file's bytes (`algorithm`: "blake2b", 20 bytes, or "sha256").
    Remembered per (path, size, mtime, inode) in a stamp file so that a model file is read
    for it once, not at every load."""
    stat = path.stat()
    known = known_digest(path, algorithm)
    if known is not None:
        return known
    stamp = _stamp(path, algorithm)
    digest = hashlib.sha256() if algorithm == "sha256" else hashlib.blake2b(digest_size=20)
    with path.open("rb") as f:
        if stat.st_size:  # hashed through a map: no copy of every byte into a buffer
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with mapped, memoryview(mapped) as view:
                for at in range(0, len(view), DIGEST_CHUNK):
                    digest.update(view[at : at + DIGEST_CHUNK])
    try:
        write_atomically(stamp, lambda target: target.write_text(digest.hexdigest()))
    except OSError:  # a read-only cache only costs the next load this hash
        pass
    return digest.hexdigest()


def known_digest(path: Path, algorithm: str = "blake2b") -> str | None:
    """`file_digest` where this machine has hashed the file as it is now, else None (no
    reading of the file)."""
    try:
        return _stamp(path, algorithm).read_text().strip()
    except OSError:
        return None


def _stamp(path: Path, algorithm: str) -> Path:
    """The file remembering `path`'s digest, named by its path, size, mtime and inode."""
    stat = path.stat()
    identity = f"{algorithm}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    return cache_dir() / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]


def write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)` beside `target`, then renamed over it: processes loading at once
    never read half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        write(Path(partial))
        os.chmod(partial, 0o644)  # mkstemp's 0600 would hide it from other users' workers
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def source_digest(*paths: Path) -> str:
    """A digest of the files of our code that made something kept here, so that what an
    older version built is never taken for this one's. Read once per process."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
