"""Show that a decode step of the tensor forward pass makes O(1) host syncs, not O(layers).

    python bench/device_profile.py [--model smollm2-135m-instruct] [--device cuda:0]
                                   [--sequences 32] [--steps 8] [--max-syncs 4]

Loads the model on the tensor path (`--device`: default cuda:0 where CUDA is usable, else
cpu with `torch_forward=True`), adds `--sequences` greedy sequences with ~32-token prompts,
steps until every one has its first token, then runs `--steps` decode steps under
`torch.profiler.profile` (CPU activity, and CUDA's on a GPU). Per decode step it prints:

- device->host copies: on CUDA the "Memcpy DtoH" device activities; on the CPU there are
  none (a CPU tensor is already on the host: `.cpu()` and `.tolist()` copy nothing), so
  the column reads 0 there;
- host syncs: `aten::_local_scalar_dense` (what `.item()` runs; `aten::item` is shown
  beside it and not added, as each item calls it), the `aten::to` / `aten::_to_copy` /
  `aten::copy_` ops that launched a DtoH copy (a copy to the CPU waits for the GPU; on
  the CPU none launches one), and ops whose output size depends on the data (`nonzero`,
  which bool indexing runs, `masked_select`, `unique`): a GPU must finish them before the
  host can go on. On the CPU these ops are counted as the ones that would sync on a GPU;
- attention calls: `aten::scaled_dot_product_attention`, or on the CPU the decode attention's
  exp (`aten::exp`), one per layer in a decode step;
- kernels: CUDA kernels launched (on the CPU: aten ops run), and the model's layer count.

Syncs per step must stay a small constant (`--max-syncs`, default 4) whatever the layer
count: more exits 1 and says so, so this doubles as the check of the GPU worker's "no host round
trip per layer". Run it on a GPU with `--device cuda`; on the CPU it checks the same code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: `runtime` lives in the repo root
    sys.path.insert(0, str(REPO))

PROMPT_TOKENS = 32
SCALAR_READ = "aten::_local_scalar_dense"
TO_HOST_OPS = ("aten::to", "aten::_to_copy", "aten::copy_")
SDPA = "aten::scaled_dot_product_attention"
# the CPU's decode attention is chunked products and one exp per layer (a fused kernel's
# result there depends on the batch's size: runtime/models/tensor_attention.py)
CPU_DECODE_EXP = "aten::exp"
# ops whose output size depends on the data: on a GPU they wait for it (bool indexing runs
# aten::nonzero); counted on the CPU too, where they would sync on a GPU
DATA_SIZED_OPS = ("aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim")
DTOH = "Memcpy DtoH"


@dataclass(frozen=True)
class ProfiledOp:
    """One profiler event: its name, whether it ran on the device (a kernel or a memcpy)
    rather than the host, and the device activities a host op launched."""

    name: str
    on_device: bool = False
    launched: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepCounts:
    """Totals over the profiled steps; `per_step` divides them."""

    dtoh_copies: int
    scalar_reads: int
    items: int
    to_host_copies: int
    data_sized: int
    sdpa_calls: int
    kernels: int  # device kernels (memcpy and memset not counted)
    aten_ops: int  # host ops, nested ones included: the CPU's stand-in for kernels

    @property
    def host_syncs(self) -> int:
        return self.scalar_reads + self.to_host_copies + self.data_sized

    def per_step(self, steps: int) -> dict[str, float]:
        names = ("dtoh_copies", "host_syncs", "scalar_reads", "items", "to_host_copies")
        names += ("data_sized", "sdpa_calls", "kernels", "aten_ops")
        return {name: getattr(self, name) / steps for name in names}


def count_syncs(ops: Iterable[ProfiledOp]) -> StepCounts:
    """Count what forces the host to wait for the device. A to-host copy is a copy op that
    launched a DtoH memcpy (only the innermost op, `aten::copy_`, launches it, so nested
    `to -> _to_copy -> copy_` counts once)."""
    dtoh = scalars = items = to_host = sized = sdpa = kernels = aten = 0
    for op in ops:
        if op.on_device:
            dtoh += DTOH in op.name
            kernels += DTOH not in op.name and "Memcpy" not in op.name and "Memset" not in op.name
            continue
        scalars += op.name == SCALAR_READ
        items += op.name == "aten::item"
        to_host += op.name in TO_HOST_OPS and any(DTOH in k for k in op.launched)
        sized += op.name in DATA_SIZED_OPS
        sdpa += op.name == SDPA or op.name == CPU_DECODE_EXP
        aten += op.name.startswith("aten::")
    return StepCounts(dtoh, scalars, items, to_host, sized, sdpa, kernels, aten)


def profiled_ops(events: Iterable[Any]) -> list[ProfiledOp]:
    """torch's FunctionEvents as `ProfiledOp`s (device activities have a non-CPU type)."""
    from torch.autograd import DeviceType

    return [
        ProfiledOp(e.name, e.device_type != DeviceType.CPU, tuple(k.name for k in e.kernels))
        for e in events
    ]


def prefill(engine: Any, n: int, steps: int) -> Any:
    """A generator with `n` greedy sequences that each have their first token, with room
    for `steps` more (and the tokens early ones make while later ones prefill)."""
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    generator = engine.new_generator()
    text = "The lighthouse keeper wrote down every ship, its flag and the weather. " * 4
    for i in range(n):
        ids = engine.encode(f"Ship {i}. {text}")[:PROMPT_TOKENS]
        generator.add(f"seq-{i}", ids, params, cache_prompt=False)
    started: set[str] = set()
    while len(started) < n:
        started.update(e.request_id for e in generator.step())
    # the first decode step: an overlapped one (runtime/generator.py `step`) gives its
    # tokens at the next call, so each profiled step reads back one step's tokens
    generator.step()
    return generator


def profile_decode(engine: Any, generator: Any, n: int, steps: int) -> StepCounts:
    """`steps` decode steps under torch's profiler; each must give all `n` a token."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(engine.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            events = generator.step()
            if len(events) != n:
                raise RuntimeError(f"a decode step gave {len(events)} tokens for {n}")
    return count_syncs(profiled_ops(prof.events()))


def render(counts: StepCounts, steps: int, layers: int, on_cuda: bool, max_syncs: float) -> str:
    per = counts.per_step(steps)
    rows = [
        ("device->host copies (Memcpy DtoH)", per["dtoh_copies"]),
        ("host syncs (the rows below, aten::item aside)", per["host_syncs"]),
        (f"  {SCALAR_READ}", per["scalar_reads"]),
        ("  aten::item (each runs one scalar read)", per["items"]),
        ("  to/_to_copy/copy_ launching a DtoH copy", per["to_host_copies"]),
        ("  data-sized ops (nonzero, masked_select, unique)", per["data_sized"]),
        ("attention calls (SDPA; on the CPU its per-row softmax)", per["sdpa_calls"]),
        ("  per layer (decode groups)", per["sdpa_calls"] / layers),
        ("CUDA kernels" if on_cuda else "CUDA kernels (none on the CPU)", per["kernels"]),
        ("aten ops (nested included)", per["aten_ops"]),
        ("layers", float(layers)),
    ]
    lines = [f"per decode step (average of {steps}):"]
    lines += [f"  {name:<50} {value:10.1f}" for name, value in rows]
    if not on_cuda:
        lines.append("  on the CPU nothing is copied device->host: the tensors are on the host")
    ok = per["host_syncs"] <= max_syncs
    lines.append(
        f"host syncs per step {per['host_syncs']:.1f} <= {max_syncs:g} "
        f"(O(1), not O(layers = {layers})): {'PASS' if ok else 'FAIL'}"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", help="cpu or cuda[:N] (default cuda:0 if usable, else cpu)")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-syncs", type=float, default=4, help="per step, else exit 1")
    args = p.parse_args(argv)
    from runtime.devices import DeviceError, check_device, cuda_available

    try:
        args.device = check_device(args.device or ("cuda:0" if cuda_available() else "cpu"))
    except DeviceError as exc:
        p.exit(2, f"{p.prog}: {exc}\n")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from runtime.devices import describe_device, is_cuda
    from runtime.engine import Engine, EngineConfig

    max_sequences = args.sequences  # every sequence in one batch
    config = EngineConfig(
        max_sequences=max_sequences, backend="torch", device=args.device, torch_forward=True
    )
    engine = Engine.load(args.model, config)
    layers = len(engine.model.layers)
    print(
        f"{args.model} on {describe_device(engine.device)}, tensor forward pass: "
        f"{engine.torch_forward}; {args.sequences} sequences of ~{PROMPT_TOKENS}-token prompts"
    )
    generator = prefill(engine, args.sequences, args.steps)
    counts = profile_decode(engine, generator, args.sequences, args.steps)
    print(render(counts, args.steps, layers, is_cuda(engine.device), args.max_syncs))
    if counts.host_syncs / args.steps > args.max_syncs:
        print(f"FAIL: more than {args.max_syncs:g} host syncs per decode step", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
