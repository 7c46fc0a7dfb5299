"""kernels/pages.py: dropping a file map's resident pages, and never anonymous memory's."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.kernels import pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


def resident_pages(array: np.ndarray) -> int:
    """Resident pages of the map holding `array` (its `Rss` in /proc/self/smaps)."""
    start = -(-array.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (array.ctypes.data + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    counted = 0
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= start < high
            elif inside and line.startswith("Rss:"):
                counted = int(line.split()[1]) * 1024 // mmap.PAGESIZE
    return counted if end > start else 0


def test_a_file_maps_pages_are_dropped_and_read_back_from_the_file(tmp_path: Path) -> None:
    values = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    (tmp_path / "w.bin").write_bytes(values.tobytes())
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.float32, mode="r")
    assert float(mapped.sum(dtype=np.float64)) == float(values.sum(dtype=np.float64))
    before = resident_pages(mapped)
    released = pages.release_array(mapped)
    assert released >= values.nbytes - 2 * mmap.PAGESIZE
    assert resident_pages(mapped) < before
    assert np.array_equal(mapped, values)  # read again, from the file


def test_anonymous_memory_is_never_dropped() -> None:
    values = np.arange(1 << 20, dtype=np.float32)
    kept = values.copy()
    assert pages.release_array(values) == 0
    tensor = torch.arange(1 << 20, dtype=torch.float32)
    assert pages.release_array(tensor) == 0
    assert np.array_equal(values, kept) and torch.equal(tensor, torch.from_numpy(kept))


def test_a_range_without_a_whole_page_releases_nothing(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(bytes(3 * mmap.PAGESIZE))
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r")
    assert pages.release(mapped.ctypes.data + 1, mmap.PAGESIZE - 2) == 0
