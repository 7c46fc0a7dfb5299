"""Which product an LM head gives each row: its fast one, or the file's precision.

A CPU plan may multiply a head by a copy cheaper than the file's codes (int8 per row, or an
int4 ranking whose best rows are rescored: runtime/kernels/torch_backend.py
`CHEAPER_HEAD_KINDS`); such a head carries `full`, the file's own product. A greedy row
needs only its argmax, which the fast product keeps; a row whose logits a user sees or
samples from (logprobs, a temperature, top-k/p, min-p, penalties, a grammar) takes `full`.
Both products give a row the same numbers whatever shares its batch, so a row's logits
depend only on what its own request asks for. numpy and torch rows alike: no torch here.

The tensor path's heads carry no `full`: a GPU's is bf16 over every row (within llama.cpp's
floor: bench/head_precision.py), a static step multiplies every row alike, and the CPU's
stand-in for it keeps the plan's head for every row as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Exact = bool | Sequence[bool] | np.ndarray | None


def head_logits(head: Any, hidden: Any, exact: Exact = None) -> Any:
    """`head` over `hidden` `[N, D]` -> `[N, V]`; the rows `exact` marks (True: all) from
    its `full` product where it has one. A mixed batch runs the fast product over every
    row and overwrites the exact rows (no scatter of two halves, for numpy and torch)."""
    full = getattr(head, "full", None)
    if full is None or exact is None or exact is False:
        return head(hidden)
    if exact is True:
        return full(hidden)
    rows = np.flatnonzero(np.asarray(exact, bool)).tolist()  # [n]
    if len(rows) == len(hidden):
        return full(hidden)
    out = head(hidden)  # [N, V]
    if rows:
        out[rows] = full(hidden[rows])
    return out
