"""LoRA adapters in fixed device slots, so that decode steps with LoRA rows replay a graph.

A captured step (runtime/decode_graphs.py) reads every tensor at the address it had at
capture, so a step cannot pick an adapter's own tensors per row. As in S-LoRA and Punica,
`LoraSlots` keeps S slots per adaptable weight (every linear weight the model built from
GGUF tensors, `linear_sources`) at fixed addresses: `a [S*R, in]` and `bt [S*R, out]`
(B transposed), R the largest rank a slot takes, a smaller rank zero-padded. Putting an
adapter in a slot copies its deltas in place (`copy_`), so the graphs keep reading the same
memory; a slot is reused least recently used first among the adapters the step does not
use. The slots are allocated when the first adapter is placed, before any LoRA graph is
captured: 4 x S x R x (in + out) bytes per weight, ~0.5 GB for SmolLM2-135M at 8 x 64.

A step's rows say which slots they use, and at what scale, in a coefficient table
`[passes, rows, S]` (float32; padding rows and rows without adapters all zeros). Pass j
holds each row's j-th adapter (its stack in key order, as `RowAdapters` adds them), so a
row's deltas are summed in the same order whatever its batch mates stack. Each adapted
linear then adds, per pass, `((x @ a.T) * coef expanded to [rows, S*R]) @ bt`: on a GPU two
small float32 GEMMs per weight (`gemm_delta`); on the CPU each row alone through the host's
kernel (`rows_delta`, runtime/kernels/dense_rows.c), because torch's CPU GEMM rounds a row
differently with the number of rows beside it. The eager tensor step computes LoRA rows the
same way whenever the engine has slots (runtime/models/tensor_ops.py `prepare`), so a row's
logits do not depend on whether its step was static or eager.

The one case not captured: a step needing more distinct adapters than slots, or an adapter
whose rank (per weight, the ranks of the tensors fused into it summed) exceeds R. It takes
the eager step with `RowAdapters` (runtime/lora.py); on the CPU that gives the same bits,
on a GPU its products are cuBLAS's at other shapes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.lora import (
    DEFAULT_LORA_RANK,
    DEFAULT_LORA_SLOTS,
    AdapterStack,
    LoraAdapter,
    add_row_deltas,
)
from runtime.models.base import BatchLayout, SequenceChunk


@dataclass
class SlotWeight:
    """One adaptable weight's slots: `a [S*R, in]`, `bt [S*R, out]` float32 on the device,
    and each slot's adapter rank for this weight (0: the adapter leaves it alone)."""

    a: torch.Tensor
    bt: torch.Tensor
    ranks: list[int] = field(default_factory=list)


Product = Callable[[torch.Tensor, torch.Tensor, SlotWeight, torch.Tensor, int], torch.Tensor]


def gemm_delta(
    x: torch.Tensor, out: torch.Tensor, weight: SlotWeight, coef: torch.Tensor, rank: int
) -> torch.Tensor:
    """`out` plus every row's deltas: per pass `((x @ a.T) * coef) @ bt`, in float32 (a GPU's
    products and inputs may be bf16); nothing read on the host, so a graph captures it."""
    x, out = x.float(), out.float()
    passes, rows, slots = coef.shape
    low = (x @ weight.a.T).view(rows, slots, rank)  # [B, in] -> [B, S, R]
    for table in coef:  # [B, S]: each row's j-th adapter
        out += (low * table[:, :, None]).view(rows, slots * rank) @ weight.bt  # -> [B, out]
    return out


def rows_delta(
    x: torch.Tensor, out: torch.Tensor, weight: SlotWeight, coef: torch.Tensor, rank: int
) -> torch.Tensor:
    """`gemm_delta` on the CPU, each row alone: per pass and slot, the rows using it at
    their scales through dense_rows.c over the slot's own rank, the bits `RowAdapters`
    gives the same row (zero scales add nothing: their delta is exactly zero)."""
    x_host = x.float().contiguous().numpy()
    out = out.float().contiguous()
    out_host = out.numpy()  # written in place
    a, bt = weight.a.numpy(), weight.bt.numpy()
    for table in coef.numpy():  # [B, S]
        for slot in np.flatnonzero(table.any(axis=0)):
            used = weight.ranks[slot]
            if used == 0:
                continue
            index = np.flatnonzero(table[:, slot])
            span = slice(slot * rank, slot * rank + used)
            add_row_deltas(x_host, index, table[index, slot, None], a[span], bt[span], out_host)
    return out


class LoraSlots:
    """S adapter slots of rank R for every adaptable weight of one model on its device."""

    def __init__(
        self, model, slots: int = DEFAULT_LORA_SLOTS, rank: int = DEFAULT_LORA_RANK
    ) -> None:
        if slots < 1 or rank < 1:
            raise ValueError(f"lora_slots and lora_rank must be >= 1, got {slots} and {rank}")
        self.count, self.rank = slots, rank
        self.device = torch.device(model.ops.device)
        weights = {id(s.weight): s.weight for s in model.linear_sources.values()}
        self.shapes = {key: w.shape for key, w in weights.items()}  # [out, in]
        self.weights: dict[int, SlotWeight] = {}  # allocated at the first placement
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, LRU first
        self.free = list(range(slots))
        self.product: Product = gemm_delta if self.device.type == "cuda" else rows_delta
        self.placements = 0  # adapters copied into a slot (a reuse evicts one)
        self._fits: dict[str, bool] = {}

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.bt.nbytes for w in self.weights.values())

    def fits(self, adapter: LoraAdapter) -> bool:
        """Whether every delta of `adapter` fits a slot's rank (asked every step: kept)."""
        fits = self._fits.get(adapter.key)
        if fits is None:
            fits = all(d.a.shape[0] <= self.rank for d in adapter.deltas.values())
            self._fits[adapter.key] = fits
        return fits

    def passes_for(self, stacks: Sequence[AdapterStack]) -> int | None:
        """Passes a step of rows with these stacks takes (the most adapters one row stacks;
        0 without any); None where the slots cannot hold the step's adapters."""
        adapters = {a.key: a for stack in stacks for a, _ in stack}
        if len(adapters) > self.count or not all(self.fits(a) for a in adapters.values()):
            return None
        return max((len(stack) for stack in stacks), default=0)

    def place(self, stacks: Sequence[AdapterStack]) -> dict[str, int]:
        """Put every adapter of `stacks` in a slot (check `passes_for` first): those already
        there stay, the others take free slots, then those used least recently outside
        this step. Returns each adapter's slot by key."""
        adapters = {a.key: a for stack in stacks for a, _ in stack}
        for key in sorted(adapters):
            if key in self.resident:
                self.resident.move_to_end(key)
        for key in sorted(adapters):
            if key not in self.resident:
                slot = self._take_slot(adapters)
                self._write(slot, adapters[key])
                self.resident[key] = slot
        return {key: self.resident[key] for key in adapters}

    def _take_slot(self, keep: dict[str, LoraAdapter]) -> int:
        if self.free:
            return self.free.pop(0)
        victim = next(key for key in self.resident if key not in keep)
        return self.resident.pop(victim)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """The adapter's deltas into `slot` of every weight, in place, zeros around them (on
        the device's stream: a step already launched reads the slot before it changes)."""
        self._allocate()
        start, end = slot * self.rank, (slot + 1) * self.rank
        for key, weight in self.weights.items():
            delta = adapter.deltas.get(key)
            used = 0 if delta is None else delta.a.shape[0]
            if delta is not None:
                a, b = delta.tensors(self.device)  # [r, in], [out, r]
                weight.a[start : start + used].copy_(a)
                weight.bt[start : start + used].copy_(b.T)
            weight.a[start + used : end].zero_()
            weight.bt[start + used : end].zero_()
            weight.ranks[slot] = used
        self.placements += 1

    def _allocate(self) -> None:
        if self.weights:
            return
        size = self.count * self.rank
        for key, (out, inp) in self.shapes.items():
            self.weights[key] = SlotWeight(
                torch.zeros((size, inp), dtype=torch.float32, device=self.device),
                torch.zeros((size, out), dtype=torch.float32, device=self.device),
                [0] * self.count,
            )

    def rows(self, layout: BatchLayout) -> SlotRows | None:
        """What an eager step's layers add for its LoRA rows, through the slots (None where
        they cannot hold the step's adapters: then `RowAdapters`)."""
        stacks = [chunk.adapters for chunk in layout.chunks]
        passes = self.passes_for(stacks)
        if passes is None:
            return None
        table = np.zeros((passes, layout.spans[-1][1], self.count), np.float32)
        self.write_table(table, [(start, end, c.adapters) for start, end, c in layout.spans])
        return SlotRows(self, torch.from_numpy(table).to(self.device))

    def write_table(
        self, table: np.ndarray, spans: Sequence[tuple[int, int, AdapterStack]]
    ) -> None:
        """Place the adapters of `spans` (first row, end row, stack) and write their scales
        into `table` `[passes, rows, S]` (zeros elsewhere): pass j holds each row's j-th
        adapter, so a row's adapters are added in key order whatever slots they take."""
        slot_of = self.place([stack for _, _, stack in spans])
        for start, end, stack in spans:
            for j, (adapter, scale) in enumerate(stack):
                table[j, start:end, slot_of[adapter.key]] = scale

    def describe(self) -> dict[str, object]:
        return {
            "slots": self.count,
            "rank": self.rank,
            "resident": len(self.resident),
            "placements": self.placements,
            "bytes": self.nbytes,
        }


class SlotRows:
    """A step's LoRA rows as the layers see them (`layout.lora`): the slots and the step's
    coefficient table `[passes, rows, S]` on the device."""

    def __init__(self, slots: LoraSlots, coef: torch.Tensor) -> None:
        self.slots, self.coef = slots, coef

    def apply(self, weight, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` = weight(x) with each row's deltas added (a weight no adapter can adapt,
        such as the LM head, is left as it is)."""
        slot_weight = self.slots.weights.get(id(weight))
        if slot_weight is None:
            return out
        return self.slots.product(x, out, slot_weight, self.coef, self.slots.rank)


class SlotCoefficients:
    """The static steps' coefficient table: a host buffer (pinned on a GPU) the host fills
    and the device buffer the graphs read, sized for the most passes and rows. A bucket of
    `rows` and `passes` reads its first passes x rows x S values."""

    def __init__(self, slots: LoraSlots, max_rows: int) -> None:
        self.slots = slots
        cuda = slots.device.type == "cuda"
        size = slots.count * max_rows * slots.count  # passes <= S: a row's adapters differ
        self.host = torch.zeros(size, dtype=torch.float32, pin_memory=cuda)
        self.on_device = self.host.to(slots.device) if cuda else self.host
        self.copied = torch.cuda.Event() if cuda else None  # refilled once the last is in

    def view(self, rows: int, passes: int) -> torch.Tensor:
        """The device table a bucket's graph reads: `[passes, rows, S]`."""
        return self.on_device[: passes * rows * self.slots.count].view(passes, rows, -1)

    def fill(self, rows: int, passes: int, chunks: Sequence[SequenceChunk]) -> None:
        """Place the step's adapters and write its table (padding rows zero) to the device."""
        if self.copied is not None:
            self.copied.synchronize()
        size = passes * rows * self.slots.count
        table = self.host[:size].numpy().reshape(passes, rows, self.slots.count)
        table[:] = 0
        self.slots.write_table(table, [(i, i + 1, c.adapters) for i, c in enumerate(chunks)])
        if self.on_device is not self.host:
            self.on_device[:size].copy_(self.host[:size], non_blocking=True)
            self.copied.record()

    def rows(self, rows: int, passes: int) -> SlotRows:
        return SlotRows(self.slots, self.view(rows, passes))
