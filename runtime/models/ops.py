"""The array operations a forward pass is written in, for the host or for a device.

An architecture file writes its layers once, in these operations plus `linear`, slicing,
reshape and `+`: the host ops work on float32 numpy arrays (attention.py over the pool's
memory-mapped blocks), the tensor ops (tensor_ops.py) on float32 torch tensors that never
leave their device. The backend that built the weights decides which a model gets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.kv_pool import lazy_array
from runtime.models import attention, base


class HostOps:
    """numpy on the CPU: what the numpy backend and the torch CPU kernels run under. The KV
    pool holds float32, or IEEE half where the torch backend's plan asks for it
    (`KernelPlan.kv`, `LLMQ_KV_CACHE=float16`, as llama.cpp's cache does)."""

    device = None
    rms_normalize = staticmethod(base.rms_normalize)
    rms_norm = staticmethod(base.rms_norm)
    rope_tables = staticmethod(base.rope_tables)
    apply_rope = staticmethod(base.apply_rope)
    silu_mul = staticmethod(base.silu_mul)
    gelu_tanh_mul = staticmethod(base.gelu_tanh_mul)
    swiglu_oai_mul = staticmethod(base.swiglu_oai_mul)
    attend = staticmethod(attention.attend_layout)

    @staticmethod
    def no_rope(x: np.ndarray) -> np.ndarray:
        """A no-rope layer's q or k (smollm3) as attention takes it: as it is."""
        return x

    @staticmethod
    def position_scale(positions: np.ndarray, scale: float, floor: int) -> np.ndarray:
        """Llama 4's attention temperature per row `[T, 1, 1]`: 1 + scale * log(floor(p /
        floor) + 1) (Ministral 3's q, llama.cpp's llm_graph_input_attn_temp)."""
        steps = np.floor(np.asarray(positions, np.float64) / floor)
        return (1.0 + scale * np.log(steps + 1.0)).astype(np.float32)[:, None, None]

    @staticmethod
    def softcap(x: np.ndarray, cap: float) -> np.ndarray:
        """cap * tanh(x / cap) (gemma2's final logits)."""
        return np.float32(cap) * np.tanh(x / np.float32(cap))

    @staticmethod
    def prepare(layout: Any, windows: list[int | None]) -> None:
        """Nothing to do before the layers: attention plans as it goes."""

    @staticmethod
    def vector(values: np.ndarray) -> np.ndarray:
        """A norm's weight as the ops use it: the float32 array itself."""
        return values

    def __init__(self, kv_dtype: np.dtype | type = np.float32) -> None:
        self.kv_dtype = np.dtype(kv_dtype)

    @property
    def kv_value_bytes(self) -> int:
        return self.kv_dtype.itemsize

    def kv_storage(self, n_kv_heads: int, tokens: int, head_dim: int) -> np.ndarray:
        """One layer's keys (or values), `[Hkv, slots, Dh]`, backed as blocks are written."""
        return lazy_array((n_kv_heads, tokens, head_dim), self.kv_dtype)

    @staticmethod
    def to_host(x: np.ndarray) -> np.ndarray:
        return x


HOST_OPS = {np.dtype(t): HostOps(t) for t in (np.float32, np.float16)}


def array_ops(backend: Any) -> Any:
    """The ops for the arrays `backend`'s weights take: a backend with a `device` (the
    tensor backend) gets tensor ops on it, every other one the host ops over a pool of
    its `kv_dtype`."""
    device = getattr(backend, "device", None)
    if device is None:
        return HOST_OPS[np.dtype(getattr(backend, "kv_dtype", None) or np.float32)]
    from runtime.models.tensor_ops import TensorOps

    return TensorOps(device)
