"""The forward pass's operations on float32 torch tensors that stay on one device.

The layers of every architecture run unchanged on these (models/ops.py): norms, rope and the
gated activations are a few torch ops each; attention is tensor_attention.py over a KV pool
kept on the device. What crosses from the host per forward pass is small and goes one way:
token ids' embedding rows, rope's cos/sin rows and attention's slot indices, all computed
from the step's layout once, never per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from runtime.kernels.device_backend import device_vector
from runtime.kv_pool import lazy_array
from runtime.models import base, tensor_attention
from runtime.models.static_decode import StaticDecodeLayout, as_index

if TYPE_CHECKING:
    from runtime.lora_slots import LoraSlots

MIN_ROPE_POSITIONS = 1024  # a rope table's first size; it doubles as positions grow


class TensorOps:
    """Operations on `device`; keys and values are kept fp16 on a GPU (as llama.cpp's
    default cache type), float32 on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.kv_dtype = torch.float16 if self.cuda else torch.float32
        self.kv_value_bytes = 2 if self.cuda else 4
        # the dtype a GPU's products take their input in (device_backend.py: int4 and dense
        # weights are bf16 where the GPU has it); None on the CPU, whose kernels take float32
        bf16 = self.cuda and torch.cuda.is_bf16_supported()
        self.product_dtype = torch.bfloat16 if bf16 else None
        # positions every rope table covers from its start: a captured step reads the
        # table at addresses fixed at capture, so the graph runner sets the context length
        self.rope_positions = 0
        # runtime/lora_slots.py: where the engine keeps LoRA slots (for its static steps),
        # an eager step's LoRA rows go through them too, as a static step's do
        self.lora_slots: LoraSlots | None = None
        self._rope: dict[tuple[bytes, float, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def vector(self, values: np.ndarray) -> torch.Tensor:
        """A float32 vector (a norm's weight) on the device."""
        return device_vector(values, self.device)

    @staticmethod
    def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last axis without its weight (folded into the next matmul); one
        fused kernel on a GPU, where a decode step is mostly kernel launches."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """With its weight; `x` may be a product's bf16 output (widened first)."""
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)

    def rope_tables(self, positions, inv_freq: np.ndarray, scale: float = 1.0, mscale=1.0):
        """cos and signed sin `[T, 1, n_rot]` of `positions` (host array, or device tensor
        in a static step), each half repeated (`apply_rope` rotates in one product): rows of
        one table per rope, computed as the host computes them and uploaded once, so every
        step, eager or captured, reads the same values."""
        needed = 0 if isinstance(positions, torch.Tensor) else int(np.max(positions)) + 1
        cos, sin = self._rope_table(inv_freq, scale, needed, mscale)
        index = as_index(positions, self.device)
        return cos[index], sin[index]

    def _rope_table(self, inv_freq: np.ndarray, scale: float, needed: int, mscale: float = 1.0):
        key = (np.asarray(inv_freq, np.float64).tobytes(), float(scale), float(mscale))
        table = self._rope.get(key)
        size = 0 if table is None else len(table[0])
        if size < max(needed, self.rope_positions):
            size = max(needed, self.rope_positions, 2 * size, MIN_ROPE_POSITIONS)
            cos, sin = base.rope_tables(np.arange(size), inv_freq, scale, mscale)  # [P, 1, n_rot/2]
            cos, sin = np.concatenate([cos, cos], -1), np.concatenate([-sin, sin], -1)
            table = torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device)
            self._rope[key] = table
        return table

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """NeoX rotation of `x` `[T, heads, Dh]`: dims i and i + n_rot/2 form a pair, so
        with the halves swapped, x * cos + swapped * sin (sin's first half negated). The
        sum is rounded straight to the KV pool's dtype (what queries and keys are used in)."""
        n_rot = cos.shape[-1]
        half = n_rot // 2
        rotating = x[..., :n_rot]
        swapped = torch.cat([rotating[..., half:], rotating[..., :half]], -1)
        if n_rot != x.shape[-1]:
            rotated = rotating * cos + swapped * sin
            return torch.cat([rotated, x[..., n_rot:]], -1).to(self.kv_dtype)
        out = torch.empty(x.shape, dtype=self.kv_dtype, device=x.device)
        return torch.addcmul(rotating * cos, swapped, sin, out=out)

    def no_rope(self, x: torch.Tensor) -> torch.Tensor:
        """A no-rope layer's q or k (smollm3) in the KV pool's dtype, as `apply_rope`
        leaves a rotated one."""
        return x.to(self.kv_dtype)

    def position_scale(self, positions, scale: float, floor: int) -> torch.Tensor:
        """Llama 4's attention temperature per row `[T, 1, 1]` (models/ops.py), computed on
        the device from the positions, eager or captured alike."""
        steps = torch.floor(as_index(positions, self.device).double() / floor)
        return (1.0 + scale * torch.log(steps + 1.0)).float()[:, None, None]

    @staticmethod
    def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * tanh(x / cap) (gemma2's final logits), in float32."""
        return torch.tanh(x.float() / cap) * cap

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """In float32 whatever the product's dtype; on a GPU rounded to the next product's
        bf16 in the same kernel (what that product would do first)."""
        return self._into_product(F.silu(gate.float()), up)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._into_product(F.gelu(gate.float(), approximate="tanh"), up)

    def swiglu_oai_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's clamped GLU (base.swiglu_oai_mul), in float32."""
        x = gate.float().clamp(max=base.SWIGLU_OAI_LIMIT)
        activated = x / (torch.exp(x * -base.SWIGLU_OAI_ALPHA) + 1.0)
        limit = base.SWIGLU_OAI_LIMIT
        return self._into_product(activated, up.float().clamp(-limit, limit) + 1.0)

    def _into_product(self, activated: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.product_dtype is None:
            return activated * up
        out = torch.empty(activated.shape, dtype=self.product_dtype, device=activated.device)
        return torch.mul(activated, up, out=out)

    def prepare(self, layout, windows: list[int | None]) -> None:
        """Attention's indices and masks for this forward pass, uploaded (or, in a static
        step, built on the device) before any layer."""
        if isinstance(layout, StaticDecodeLayout):
            layout.prepare()
            return
        if layout.lora is not None and self.lora_slots is not None:
            layout.lora = self.lora_slots.rows(layout) or layout.lora
        tensor_attention.prepare(layout, windows, self.device)

    @staticmethod
    def attend(layer, q, k, v, layout, window=None, softcap=None, sinks=None) -> torch.Tensor:
        if isinstance(layout, StaticDecodeLayout):
            return tensor_attention.attend_static(layer, q, k, v, layout, window, softcap, sinks)
        return tensor_attention.attend_layout(layer, q, k, v, layout, window, softcap, sinks)

    def kv_storage(self, n_kv_heads: int, tokens: int, head_dim: int) -> torch.Tensor:
        """One layer's keys (or values), slot-major `[slots, Hkv, Dh]` so that a gather
        of slots is one index; on the CPU backed only as blocks are written."""
        if self.cuda:
            return torch.zeros(
                (tokens, n_kv_heads, head_dim), dtype=self.kv_dtype, device=self.device
            )
        return torch.from_numpy(lazy_array((tokens, n_kv_heads, head_dim)))

    @staticmethod
    def to_host(x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()
