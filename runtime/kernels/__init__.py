"""The kernel layer: how a weight is stored and multiplied, chosen per tensor at load.

Model files build their weights through a `Backend` (`backend.linear(file, parts)`) and
apply them with `linear(x, w)`; they never see the storage. Two backends:

- `numpy`: float32 weights and OpenBLAS, exact; the reference every faster path is tested
  against, and what runs where torch is not installed.
- `torch`: weights kept compact (per CPU: GGUF's 4-bit types as torch's group-wise int4,
  the rest bf16; or fp16 throughout; the LM head int8 per row where accurate enough) and
  multiplied by torch's compiled CPU kernels.

- `torch` on a device (device_backend.py): weights that multiply torch tensors on the CPU
  or a CUDA GPU, for the tensor forward pass that keeps every activation on the device.

`get_backend(None)` picks torch when it is importable, else numpy.
"""

from __future__ import annotations

import importlib.util

from runtime.kernels.base import Backend, Embedding, TensorPart, Weight
from runtime.kernels.cpu import KernelPlan

BACKENDS = ("numpy", "torch")
BACKEND_ENV = "LLMQ_BACKEND"

__all__ = ["BACKENDS", "BACKEND_ENV", "Backend", "Embedding", "TensorPart", "Weight"]


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def default_backend_name() -> str:
    return "torch" if torch_available() else "numpy"


def get_backend(
    name: str | None = None, device: str | None = None, plan: KernelPlan | None = None
) -> Backend:
    """The backend called `name` (None: the default); a clear error for an unknown one.
    With a `device` ("cpu", "cuda:N"), torch's tensor backend on it whatever `name` says
    (only torch has one; runtime/placement.py refuses another name): its weights multiply
    device tensors, for the tensor forward pass. `plan`: torch's CPU kernels (None: this
    CPU's, kernels/cpu.py)."""
    name = name or default_backend_name()
    if device is not None:
        if not torch_available():
            raise ValueError(f"the tensor forward pass on {device} needs torch")
        from runtime.kernels.device_backend import DeviceBackend

        return DeviceBackend(device, plan)
    if name == "numpy":
        from runtime.kernels.numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "torch":
        if not torch_available():
            raise ValueError(
                "backend 'torch' needs torch: pip install torch==2.13.0 (make install does this)"
            )
        from runtime.kernels.torch_backend import TorchBackend

        return TorchBackend(plan)
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
