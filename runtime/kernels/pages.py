"""Giving back the resident pages of mapped data a load has turned into something else.

A load reads the model file (and the prepared-weights file, kernels/prepared.py) through
memory maps; every page it touches stays resident and counts in the process's RSS until the
kernel needs the memory. Most of those pages are dead once a weight is built: an fp16
weight is repacked by fbgemm into its own memory, an int4 one is requantized. Telling the
kernel so (`madvise(MADV_DONTNEED)`) drops them from this process at once: Gemma 3's
146 MiB of fp16 sources in the prepared file stayed resident beside their packed copies.

Safe because only pages of a file map are ever dropped (checked in /proc/self/maps: an
anonymous page dropped would read back as zeros): one dropped and read again is read again
from the file (the GGUF embedding rows and a rescored head's rows are, on demand). Only
whole pages inside the data are dropped, never a neighbour's partial page.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from functools import cache
from typing import Any

MADV_DONTNEED = 4  # <sys/mman.h> on Linux


@cache
def _madvise() -> Any:
    """libc's madvise, or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def release(address: int, nbytes: int) -> int:
    """Drop this process's resident pages wholly inside [address, address + nbytes) if that
    range lies in one map of a file; the bytes released (0 where nothing could be)."""
    madvise = _madvise()
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if madvise is None or end <= start or not _in_file_map(start, end):
        return 0
    return end - start if madvise(start, end - start, MADV_DONTNEED) == 0 else 0


def _in_file_map(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one map with a backing file (a nonzero inode)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high:
                return end <= high and fields[4] != "0"
    return False


def release_array(values: Any) -> int:
    """`release` of a numpy array's or a torch tensor's bytes (a view of a file map)."""
    if hasattr(values, "data_ptr"):  # torch
        return release(values.data_ptr(), values.numel() * values.element_size())
    return release(values.ctypes.data, values.nbytes)
