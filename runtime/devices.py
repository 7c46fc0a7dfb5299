"""Where an engine's forward pass runs: "cpu", or an NVIDIA GPU as "cuda" / "cuda:N".

A device string is checked once, where it is first given (worker start, registry load,
engine load), and every problem is one line a person can act on: no torch, a torch without
CUDA, a GPU index that does not exist. There is never a silent CPU run for a GPU request.

On "cpu" the engine runs its host path (numpy arrays through the kernel backend). On a CUDA
device every tensor of the forward pass lives on the GPU (runtime/kernels/device_backend.py,
runtime/models/tensor_ops.py); the same tensor path also runs on "cpu" when asked for
(`EngineConfig.torch_forward`), which is how CI tests the GPU's code without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.errors import LLMQRuntimeError

CPU = "cpu"
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")


class DeviceError(LLMQRuntimeError):
    """A device that cannot be used here: a malformed name, no torch, no CUDA, no such GPU."""


class DeviceMemoryError(LLMQRuntimeError):
    """A model (or its KV pool) does not fit the memory the device has free."""


def parse_device(device: str) -> str:
    """`device` checked for form only ("cpu", "cuda", "cuda:N"); "cuda" means "cuda:0"."""
    if not isinstance(device, str) or not DEVICE_PATTERN.match(device.strip()):
        raise DeviceError(f"device must be cpu or cuda[:N], got {device!r}")
    device = device.strip()
    return "cuda:0" if device == "cuda" else device


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def check_device(device: str) -> str:
    """`device` normalised, after making sure this machine can run on it."""
    device = parse_device(device)
    if not is_cuda(device):
        return device
    try:
        import torch
    except ImportError:
        raise DeviceError(
            f"device {device} needs torch with CUDA; torch is not installed"
        ) from None
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {device}: this torch ({torch.__version__}) sees no CUDA device; "
            "install a CUDA build of torch on a machine with an NVIDIA GPU, or use --device cpu"
        )
    index, count = int(device.split(":")[1]), torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {device}: this machine has {count} CUDA device(s)")
    return device


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the driver reports it now (bytes)."""

    free: int
    total: int


def device_memory(device: str) -> DeviceMemory | None:
    """Free and total memory of a CUDA device; None for the CPU (the pool's budget and the
    operating system bound that)."""
    if not is_cuda(device):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceMemory(int(free), int(total))


def describe_device(device: str) -> str:
    """ "cpu", or e.g. "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)" for logs and /admin."""
    if not is_cuda(device):
        return device
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def cuda_available() -> bool:
    """Whether a CUDA device can be used here (torch installed with CUDA, one GPU seen)."""
    try:
        check_device("cuda:0")
    except DeviceError:
        return False
    return True
