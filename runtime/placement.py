"""Where an engine puts its model and KV pool, and how a GPU that is too small says so.

The CPU runs the host forward pass (numpy arrays through the kernel backend) unless the
tensor forward pass is asked for; a CUDA device always runs the tensor forward pass, with
weights, KV pool and activations on the GPU. A model that does not fit a GPU is a
`DeviceMemoryError` at load, before anything is allocated where the estimate already says
so, and translated from torch's out-of-memory error otherwise: a worker marks the model
failed and goes on serving the others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from runtime.devices import CPU, DeviceError, DeviceMemoryError, check_device, device_memory
from runtime.devices import is_cuda as on_cuda
from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, KernelPlan, get_backend
from runtime.models import estimate_weight_bytes, load_model

CPU_KV_MB = 1024  # pages are backed only as blocks are written
CUDA_KV_SHARE = 0.5  # of the memory free once the weights are loaded
CUDA_KV_MAX_MB = 16384  # the default share's cap; a share given explicitly has none
GPU_SHARE_ENV = "LLMQ_GPU_MEMORY_UTILIZATION"  # what `--gpu-memory-utilization` sets


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:N"
    torch_forward: bool  # the tensor forward pass (always on CUDA)
    backend: Backend


def place(
    device: str | None,
    torch_forward: bool | None,
    backend_name: str | None,
    plan: KernelPlan | None = None,
) -> Placement:
    """The checked device, whether the tensor forward pass runs, and the backend for it
    (`plan`: torch's CPU kernels, None for this CPU's)."""
    device = check_device(device or CPU)
    tensor_path = on_cuda(device) if torch_forward is None else torch_forward
    if on_cuda(device) and not tensor_path:
        raise DeviceError(f"device {device} runs only the tensor forward pass")
    if tensor_path and backend_name not in (None, "torch"):
        raise DeviceError(
            f"the tensor forward pass on {device} needs the torch backend, not {backend_name!r}"
        )
    if tensor_path:
        backend = get_backend("torch", device, plan)
    else:
        backend = get_backend(backend_name, plan=plan)
    return Placement(device, tensor_path, backend)


@contextlib.contextmanager
def device_memory_guard(device: str, what: str) -> Iterator[None]:
    """torch's out-of-memory error on `device` as a `DeviceMemoryError` about `what`."""
    if not on_cuda(device):
        yield
        return
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        raise DeviceMemoryError(f"{what} does not fit {device}: {exc}".split("\n")[0]) from None


def load_placed(gguf_file: GGUFFile, placement: Placement, model_id: str):
    """The model on its device; on a GPU, refused before loading when its weights alone
    are more than the device has free."""
    free = device_memory(placement.device)
    if free is not None:
        need = estimate_weight_bytes(gguf_file, placement.backend)
        if need > free.free:
            raise DeviceMemoryError(
                f"{model_id} needs about {need / 2**20:.0f} MiB for its weights, but "
                f"{placement.device} has {free.free / 2**20:.0f} MiB free"
            )
    with device_memory_guard(placement.device, model_id):
        return load_model(gguf_file, placement.backend)


def gpu_kv_share(share: float | None = None) -> float | None:
    """The KV pool's share of the GPU memory free after the weights: `share`, else
    $LLMQ_GPU_MEMORY_UTILIZATION, else None (the default: CUDA_KV_SHARE, capped)."""
    if share is None:
        text = os.environ.get(GPU_SHARE_ENV)
        if not text:
            return None
        try:
            share = float(text)
        except ValueError:
            raise DeviceError(
                f"{GPU_SHARE_ENV} must be a number in (0, 0.95], got {text!r}"
            ) from None
    if not 0.0 < share <= 0.95:
        raise DeviceError(f"gpu_memory_utilization must be in (0, 0.95], got {share}")
    return share


def kv_budget_bytes(kv_memory_mb: int | None, device: str, share: float | None = None) -> int:
    """The KV pool's bytes: as configured, else 1 GiB on the CPU and, on a GPU, `share` of
    what is free after the weights (`gpu_kv_share`; by default half, at most
    CUDA_KV_MAX_MB)."""
    if kv_memory_mb is not None:
        return kv_memory_mb * 2**20
    free = device_memory(device)
    if free is None:
        return CPU_KV_MB * 2**20
    share = gpu_kv_share(share)
    if share is not None:
        return int(free.free * share)
    return int(min(free.free * CUDA_KV_SHARE, CUDA_KV_MAX_MB * 2**20))


def check_minimal_pool(budget: int, one_sequence: int, device: str, model_id: str) -> None:
    """Refuse, saying what to change, a GPU pool that cannot hold one sequence of the
    model's context: the model would load and then fail every long request."""
    if not on_cuda(device) or budget >= one_sequence:
        return
    raise DeviceMemoryError(
        f"the KV pool of {model_id} gets {budget / 2**20:.0f} MiB on {device}, but one "
        f"sequence of its context needs {one_sequence / 2**20:.0f} MiB: raise "
        "--gpu-memory-utilization (or --kv-memory-mb), lower the context (max_context), "
        "or free GPU memory"
    )
