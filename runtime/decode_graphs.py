"""Decode steps replayed from captured CUDA graphs, one per bucket.

A GPU decode step launches ~50 kernels per layer from Python; at small batches the GPU
waits on the host. `DecodeGraphs` runs a decode step as the static step of
runtime/models/static_decode.py: on a GPU it captures that step once per bucket (batch
rows x table width) when the model loads, all graphs in one memory pool, and a step is
then one copy of the packed inputs, one replay and the logits left on the device for the
sampler (whose copy of the token ids back is the step's one host sync). On the CPU the
same static step runs uncaptured: that is how CI checks it against the eager step.

A step takes the static path only when every row decodes one token (`bucket_for`):
prefill chunks and mixed steps take the eager forward pass. Rows with LoRA adapters run in
a LoRA bucket, a separate graph of the same rows and widths per stack depth: the adapters
sit in the engine's device slots (runtime/lora_slots.py) and a per-row coefficient table,
filled by the host like the packed inputs, says which slots each row adds at what scale,
so each adapted weight costs two small products more. LoRA graphs are captured at their
bucket's first use, not at load. A step whose adapters the slots cannot hold (more
distinct adapters than slots, a rank above theirs) takes the eager step. Sampling is
outside the graph, so grammar masks, logprobs and penalties work on the graph's logits as
on the eager step's.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from runtime.kv_pool import BlockPool
from runtime.lora_slots import LoraSlots, SlotCoefficients
from runtime.models.base import SequenceChunk
from runtime.models.static_decode import (
    BATCH_BUCKETS,
    Bucket,
    StaticInputs,
    batch_bucket,
    decode_widths,
    group_widths,
    width_buckets,
)

log = logging.getLogger("llmq.graphs")

# a bucket is captured only if its gathered keys and values stay under this many bytes
# per layer (larger ones take the eager step): 256 rows x 8192 positions of SmolLM2 is 1.6 GB
MAX_GATHER_BYTES = 1 << 30


class DecodeGraphs:
    """The static decode step of one model over its engine's KV pool, per bucket; on a
    CUDA device each bucket's step is captured (`capture`) and replayed."""

    def __init__(
        self, model, pool: BlockPool, max_rows: int, lora_slots: LoraSlots | None = None
    ) -> None:
        self.model, self.pool = model, pool
        self.device = torch.device(model.ops.device)
        self.cuda = self.device.type == "cuda"
        max_blocks = -(-model.context_length // pool.block_size)
        self.batches = (*(b for b in BATCH_BUCKETS if b < max_rows), max_rows)
        self.widths = width_buckets(max_blocks)
        self.buckets = [
            Bucket(rows, group_widths(pool, width))
            for rows in self.batches
            for width in self.widths
            if self._gather_bytes(rows, width) <= MAX_GATHER_BYTES
        ]
        self.bucket_set = set(self.buckets)
        model.ops.rope_positions = model.context_length  # tables fixed before any capture
        self.inputs = self._new_inputs()
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_handle = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0  # device memory the graphs' pool took
        self.last_bucket: Bucket | None = None  # the last step's (benches read it)
        # LoRA rows: the engine's adapter slots and the static steps' coefficient table
        self.slots = lora_slots
        self.coefficients = None if lora_slots is None else SlotCoefficients(lora_slots, max_rows)
        self.capturing = self.cuda  # False once a capture failed: LoRA steps run uncaptured

    def _gather_bytes(self, rows: int, width: int) -> int:
        positions = width * self.pool.block_size
        return 2 * rows * positions * self.pool.n_kv_heads * self.pool.head_dim * 2

    def bucket_for(self, chunks: Sequence[SequenceChunk]) -> Bucket | None:
        """The bucket a decode step of `chunks` runs in; None: it takes the eager step (a
        prefill chunk, too many rows or positions, LoRA adapters the slots cannot hold)."""
        if any(c.length != 1 for c in chunks):
            return None
        passes = self._lora_passes(chunks)
        rows = batch_bucket(len(chunks), self.batches)
        if rows is None or passes is None:
            return None
        bucket = Bucket(rows, decode_widths(self.pool, chunks))
        return replace(bucket, lora=passes) if bucket in self.bucket_set else None

    def _lora_passes(self, chunks: Sequence[SequenceChunk]) -> int | None:
        """The LoRA passes of a step (0 without adapters); None where no slots hold them."""
        if not any(c.adapters for c in chunks):
            return 0
        return None if self.slots is None else self.slots.passes_for([c.adapters for c in chunks])

    def run(
        self,
        tokens: Sequence[int],
        chunks: Sequence[SequenceChunk],
        bucket: Bucket | None = None,
        previous: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[n, V]` (on the device) of one decode step of `chunks` fed `tokens`, in
        `bucket` (the caller's `bucket_for`, else looked up); the caches then hold the
        step's keys and values. With `previous`, `tokens` are row numbers into it: the
        token ids an earlier step sampled, still on the device (`StaticInputs.fill`)."""
        bucket = bucket or self.bucket_for(chunks)
        if bucket is None:
            raise ValueError("this step has no bucket: check bucket_for first")
        if chunks[0].cache.pool is not self.pool:  # the engine's pool was replaced (tests)
            self._follow_pool(chunks[0].cache.pool)
        self.last_bucket = bucket
        if bucket.lora:
            self._fill_lora(bucket, chunks)
        self.inputs.fill(bucket, tokens, chunks, previous)
        captured = self.graphs.get(bucket)
        if captured is not None:
            graph, logits = captured
            graph.replay()
        else:
            logits = self._step(bucket)
        for chunk in chunks:
            chunk.cache.commit(chunk.start + 1)
        return logits[: len(chunks)]

    def _follow_pool(self, pool: BlockPool) -> None:
        """Static inputs (and graphs, which read the pool at fixed addresses) for `pool`."""
        self.pool, self.graphs = pool, {}
        self.inputs = self._new_inputs()
        self.capture()

    def _new_inputs(self) -> StaticInputs:
        return StaticInputs(self.pool, max(self.buckets, key=lambda b: b.size), self.device)

    def _step(self, bucket: Bucket) -> torch.Tensor:
        """The model's forward pass and head over the bucket's static inputs."""
        layout = self.inputs.layout(bucket)
        if bucket.lora:
            layout.lora = self.coefficients.rows(bucket.rows, bucket.lora)
        return self.model.logits(self.model.forward(layout.tokens, layout))  # [B, V]

    def _fill_lora(self, bucket: Bucket, chunks: Sequence[SequenceChunk]) -> None:
        """A LoRA step's adapters into their slots and its coefficient table; on a GPU its
        graph is captured at the bucket's first use (before the inputs are filled: the
        capture runs on padding rows)."""
        self.coefficients.fill(bucket.rows, bucket.lora, chunks)  # places the adapters first
        if self.capturing and bucket not in self.graphs:
            self._capture_lora(bucket)

    def _capture_lora(self, bucket: Bucket) -> None:
        """Capture one LoRA bucket's step in the graphs' pool. LoRA graphs are captured
        lazily: there are as many as plain ones per stack depth, and a deployment that
        never sees an adapter should not pay their capture time and memory at load."""
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool_handle = self.pool_handle or torch.cuda.graph_pool_handle()
        try:
            with self._side_stream():
                self.inputs.fill(bucket, [], [])
                torch.cuda.synchronize(self.device)
                self._step(bucket)  # lazy tables, cuBLAS handles for the new shapes
                self.graphs[bucket] = self._captured(bucket)
        except RuntimeError:
            log.exception("capturing a LoRA decode graph failed: LoRA steps run uncaptured")
            self.capturing = False
            torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - started
        self.graph_bytes += max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def capture(self) -> None:
        """Capture every bucket's step (largest first, so the smaller ones reuse its memory
        in the shared pool); each batch size is run once eagerly before its first capture."""
        if not self.cuda:
            return
        try:
            self._capture_all()
        except RuntimeError:  # a kernel this GPU or torch cannot capture: decode eagerly
            log.exception("capturing the decode graphs failed: decode steps run uncaptured")
            self.graphs, self.capturing = {}, False
            torch.cuda.synchronize(self.device)

    def _capture_all(self) -> None:
        started = time.perf_counter()
        gc.collect()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool_handle = torch.cuda.graph_pool_handle()
        with self._side_stream():
            warmed: set[int] = set()
            for bucket in sorted(self.buckets, key=lambda b: -b.size):
                self.inputs.fill(bucket, [], [])
                torch.cuda.synchronize(self.device)  # the inputs are in before the run
                if bucket.rows not in warmed:  # lazy tables, cuBLAS handles per shape
                    self._step(bucket)
                    warmed.add(bucket.rows)
                self.graphs[bucket] = self._captured(bucket)
        self.capture_seconds = time.perf_counter() - started
        self.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info(
            "captured %d decode graphs in %.2f s (%.0f MiB)",
            len(self.graphs),
            self.capture_seconds,
            self.graph_bytes / 2**20,
        )

    @contextmanager
    def _side_stream(self) -> Iterator[None]:
        """Captures run on a side stream (a capture may not use the default one), joined
        back to the current stream and the device synchronized after."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                yield
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize(self.device)

    def _captured(self, bucket: Bucket) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket's step captured (its inputs filled, its shapes warmed up)."""
        # capture_begin/end, not torch.cuda.graph(), whose every entry runs a garbage
        # collection (~100 ms in a loaded worker). thread_local: a worker's other models
        # decode on its main thread while this one loads in the pool's (workers/pool.py)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool_handle, capture_error_mode="thread_local")
        try:
            logits = self._step(bucket)
        finally:
            graph.capture_end()
        return graph, logits

    def describe(self) -> dict[str, object]:
        return {
            "graphs": len(self.graphs),
            "lora graphs": sum(1 for b in self.graphs if b.lora),
            "lora slots": None if self.slots is None else self.slots.describe(),
            "buckets": len(self.buckets),
            "batch buckets": list(self.batches),
            "width buckets (blocks)": list(self.widths),
            "capture seconds": round(self.capture_seconds, 3),
            "graph bytes": self.graph_bytes,
        }
