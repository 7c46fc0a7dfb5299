"""The tensor backend: weights that take and give torch tensors on one device.

The tensor forward pass (runtime/models/tensor_ops.py) keeps every activation on the
device, so its weights must multiply device tensors and return device tensors:

- on a CUDA device: GGUF's 4-bit types as torch's CUDA int4 layout (group 32, bf16 scale and
  zero per group) where the GPU runs that kernel and a load-time check of its product
  passes, else bf16 (fp16 on GPUs without bf16); every other weight and the LM head bf16.
- on the CPU: the CPU plan's own weights (torch_backend.py: int4 / int8 / bf16 / fp16 per
  CPU), through their tensor `product`, with torch's int4 kernel for 4-bit weights as on
  CUDA (bf16 activations) rather than the host path's lowbit_rows.c. This is how CI runs
  the GPU's code path.

The token embedding stays in the mapped file on the host: a step dequantizes only its own
rows and uploads them with the token ids, one small copy per forward pass (T x D floats).
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager

import numpy as np
import torch

from runtime.gguf_file import GGUFFile
from runtime.kernels.base import TensorPart
from runtime.kernels.cpu import KernelPlan
from runtime.kernels.gguf_blocks import FOUR_BIT_TYPES, GROUP_SIZE, GroupQuantized
from runtime.kernels.quant_types import device_kept_as, log_types
from runtime.kernels.torch_backend import (
    HEAD_CHUNK_ROWS,
    BlockEmbedding,
    TorchBackend,
    dequantize_groups,
    group_part,
)

log = logging.getLogger("llmq.kernels")

# the CUDA int4 packing retiles K into inner tiles of 16 weights: 8, 4 or 2 of them per
# tile, which must divide K (SmolLM2's K = 576 takes 4, Gemma 3's 640 takes 8)
CUDA_INNER_K_TILES = (8, 4, 2)
CUDA_K_TILE = 16
# the int4 product of a random input must match the dequantized weight's product this
# closely (relative RMS) for the int4 kernel to be used; bf16 rounding alone gives ~0.5%
INT4_CHECK_TOLERANCE = 0.03


def device_vector(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A float32 copy of `values` on `device` (a copy: the file's arrays are read-only)."""
    return torch.from_numpy(np.array(values, np.float32)).to(device)


class TensorWeight:
    """A CPU plan's weight (torch_backend.py) called with float32 tensors."""

    def __init__(self, weight) -> None:
        self.weight = weight
        self.shape: tuple[int, int] = weight.shape
        self.kind: str = weight.kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.product(x)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class DenseDeviceWeight:
    """`[out, in]` in bf16 or fp16 on the device, multiplied by cuBLAS; an RMSNorm weight
    before it is folded into its columns. Like every device weight, its product is left
    in the weight's dtype (the next op widens it exactly, in the kernel it runs anyway);
    the LM head's (`float_out`) is float32, what the samplers take."""

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
        float_out: bool = False,
    ) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self.float_out = float_out
        self.kind = "bf16" if dtype == torch.bfloat16 else "fp16"
        self.weight = torch.empty(self.shape, dtype=dtype, device=device)

    @classmethod
    def from_dense(cls, dense: torch.Tensor, dtype: torch.dtype, device: torch.device):
        weight = cls(tuple(dense.shape), dtype, device)
        weight.fill(0, dense)
        return weight

    def fill(self, start: int, rows: torch.Tensor) -> None:
        self.weight[start : start + len(rows)] = rows.to(self.weight.device, self.weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)
        return out.float() if self.float_out else out

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class CudaInt4Weight:
    """torch's CUDA int4 layout: value = (code - 8) * scale + zero per 32 weights of a row,
    codes packed two to a byte, then retiled by `_convert_weight_to_int4pack`."""

    kind = "int4"

    def __init__(self, q: GroupQuantized, input_scale: torch.Tensor | None, device) -> None:
        self.shape: tuple[int, int] = q.shape
        codes = torch.from_numpy(q.codes).to(torch.uint8)  # [N, K], values 0..15
        packed = (codes[:, ::2] << 4) | codes[:, 1::2]  # [N, K/2]: even k in the high nibble
        self.packed = torch.ops.aten._convert_weight_to_int4pack(
            packed.to(device), inner_k_tiles(q.shape[1])
        )
        zeros = q.mins + np.float32(8) * q.scales
        pairs = np.stack([q.scales, zeros], axis=-1).transpose(1, 0, 2)  # [K/32, N, 2]
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(pairs)).to(device, torch.bfloat16)
        self.input_scale = input_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(
            as_bf16(x, self.input_scale), self.packed, GROUP_SIZE, self.scales_zeros
        )  # [T, K] -> [T, N], bf16: the next op widens it

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def as_bf16(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """`x` (times `scale`, a folded RMSNorm weight) in bf16: the product in float32 and
    its rounding in one kernel, as a decode step is mostly kernel launches on a GPU."""
    if scale is None:
        return x.to(torch.bfloat16)
    return torch.mul(x, scale, out=torch.empty(x.shape, dtype=torch.bfloat16, device=x.device))


def inner_k_tiles(k: int) -> int:
    """The largest inner tile count of the CUDA int4 packing whose tile divides `k`."""
    for tiles in CUDA_INNER_K_TILES:
        if k % (tiles * CUDA_K_TILE) == 0:
            return tiles
    smallest = min(CUDA_INNER_K_TILES) * CUDA_K_TILE
    raise ValueError(f"int4 weights need K divisible by {smallest}, got {k}")


def int4_matches_dense(weight: CudaInt4Weight, q: GroupQuantized, device) -> bool:
    """Whether the int4 kernel reproduces the dequantized weight's product: a GPU or torch
    build whose packing differs must fall back to bf16, never compute wrong products."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, q.shape[1], generator=generator).to(device)
    rows = min(q.shape[0], 256)
    scaled = x if weight.input_scale is None else x * weight.input_scale
    expected = scaled @ dequantize_groups(q.take_rows(np.arange(rows))).to(device).T  # [4, rows]
    try:
        got = weight(x)[:, :rows]
    except RuntimeError as exc:  # no kernel for this GPU (int4 needs sm_80 or newer)
        log.info("CUDA int4 kernel unavailable (%s): 4-bit weights go bf16", exc)
        return False
    error = float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))
    return error < INT4_CHECK_TOLERANCE


class DeviceEmbedding:
    """Embedding rows dequantized on the host from the mapped file, uploaded per step; on a
    GPU, a static step (runtime/models/static_decode.py) reads them from a float32 copy of
    the whole table on the device instead (made at its first use, the same values), since
    a captured graph cannot call the host."""

    def __init__(self, f: GGUFFile, name: str, device: torch.device) -> None:
        self.table = BlockEmbedding(f, name)
        self.shape = self.table.shape
        self.device = device
        self.on_device: torch.Tensor | None = None  # [V, D], built by `device_table`

    def __call__(self, tokens: np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):  # token ids already on the device
            if self.device.type != "cuda":
                return torch.from_numpy(self.table(tokens.numpy()))
            return self.device_table()[tokens]  # [T] -> [T, D]
        return torch.from_numpy(self.table(tokens)).to(self.device)  # [T] -> [T, D]

    def device_table(self) -> torch.Tensor:
        if self.on_device is None:
            rows, dim = self.shape
            table = torch.empty((rows, dim), dtype=torch.float32, device=self.device)
            for start in range(0, rows, HEAD_CHUNK_ROWS):
                ids = np.arange(start, min(rows, start + HEAD_CHUNK_ROWS))
                table[start : start + len(ids)] = torch.from_numpy(self.table(ids))
            self.on_device = table
        return self.on_device

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + (0 if self.on_device is None else self.on_device.nbytes)


class DeviceBackend:
    """Weights on `device` ("cpu" or "cuda:N") that multiply device tensors."""

    name = "torch"

    def __init__(self, device: str, plan: KernelPlan | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # the CPU plan supplies the CPU's kernels (and gives torch the CPU's cores)
        # torch's own int4 kernel on the CPU as on CUDA (bf16 activations), not the host
        # path's lowbit_rows.c: this path stands in for the GPU's
        self.cpu = None if self.cuda else TorchBackend(plan, native_lowbit=False)
        self.dense_dtype = torch.bfloat16
        if self.cuda and not torch.cuda.is_bf16_supported():
            self.dense_dtype = torch.float16
        self.int4 = self.cuda  # until a weight's check fails on this GPU
        self.int4_checked: set[tuple[int, int]] = set()  # shapes whose product matched

    def describe_kept(self, qtype) -> str:
        """How a weight of `qtype` is kept and multiplied (`llmq models`, the load log)."""
        return device_kept_as(self, qtype)

    def loading(self, f: GGUFFile) -> AbstractContextManager[None]:
        """On the CPU, the CPU backend's prepared weights; a GPU's are built at every load."""
        if self.cpu is not None:
            return self.cpu.loading(f)
        log_types(f, self)  # each type and how it is kept; those held dequantized by name
        return contextlib.nullcontext()

    def linear(self, f: GGUFFile, parts: list[TensorPart], input_scale: np.ndarray | None = None):
        if self.cpu is not None:
            return TensorWeight(self.cpu.linear(f, parts, input_scale))
        four_bit = all(f.blocks(p.name)[1] in FOUR_BIT_TYPES for p in parts)
        if four_bit:
            fused = GroupQuantized.concat([group_part(f, p) for p in parts])
            if self.int4:
                scale = None if input_scale is None else device_vector(input_scale, self.device)
                weight = CudaInt4Weight(fused, scale, self.device)
                # once per shape (the kernel's tiling depends on it), not per weight
                if fused.shape in self.int4_checked or int4_matches_dense(
                    weight, fused, self.device
                ):
                    self.int4_checked.add(fused.shape)
                    return weight
                self.int4 = False
                log.warning("CUDA int4 product does not match its weights: using bf16")
            dense = dequantize_groups(fused)
        else:
            dense = torch.from_numpy(np.concatenate([p.dense(f) for p in parts], axis=0))
        if input_scale is not None:
            dense = dense * torch.from_numpy(np.array(input_scale, np.float32))[None, :]
        return DenseDeviceWeight.from_dense(dense, self.dense_dtype, self.device)

    def embedding(self, f: GGUFFile, name: str) -> DeviceEmbedding:
        return DeviceEmbedding(f, name, self.device)

    def head(self, f: GGUFFile, name: str, tied: object | None = None):
        if self.cpu is not None:
            return TensorWeight(self.cpu.head(f, name, tied))
        shape = f.blocks(name)[2]
        head = DenseDeviceWeight(
            (shape[0], shape[1]), self.dense_dtype, self.device, float_out=True
        )
        for start in range(0, shape[0], HEAD_CHUNK_ROWS):  # no float32 copy of the whole head
            head.fill(start, torch.from_numpy(f.rows(name, slice(start, start + HEAD_CHUNK_ROWS))))
        return head

    def describe(self) -> dict[str, str]:
        if self.cpu is not None:
            return {"device": "cpu (tensor forward pass)", **self.cpu.describe()}
        dense = "bf16" if self.dense_dtype == torch.bfloat16 else "fp16"
        return {
            "device": str(self.device),
            "4-bit weights": "int4" if self.int4 else dense,
            "other weights": dense,
            "lm head": dense,
        }

    def stored_bytes(self, f: GGUFFile, name: str, role: str) -> int:
        if self.cpu is not None:
            return self.cpu.stored_bytes(f, name, role)
        blocks, qtype, shape = f.blocks(name)
        n = int(np.prod(shape))
        if role == "embedding":
            return int(blocks.nbytes)  # stays in the mapped file, on the host
        if role == "linear" and qtype in FOUR_BIT_TYPES and self.int4:
            return n // 2 + 4 * (n // GROUP_SIZE)
        return 4 * n if role == "vector" else 2 * n
