"""Decode from captured CUDA graphs against the eager step, side by side in one run.

    python bench/decode_graphs.py [--device cuda] [--model smollm2-135m-instruct]
                                  [--sequences 1,32,256] [--prompt-tokens 512] [--steps 64]
                                  [--batch-prompt-tokens 32] [--modes graphs,eager,sync,lora]

For each mode it loads the model: graphs (runtime/decode_graphs.py, captured at load on a
GPU, consecutive steps overlapped: runtime/generator.py), eager (the same engine with
`decode_graphs=False`), sync (graphs, each step waiting for its tokens: `overlap=False`),
lora (graphs, every sequence with one of 4 random rank-8 LoRA adapters in the engine's
slots, runtime/lora_slots.py), compiled (the static step under
torch.compile(mode="reduce-overhead"): inductor's fusion and CUDA graphs instead of ours).
Then, per batch size, it prefills that many greedy sequences with random prompts
(`--prompt-tokens` alone, else `--batch-prompt-tokens`; EOS ignored) and times `--steps`
decode steps: tokens a second, ms a step, the first decode step (a compile, where there is
one) and a replay alone (the GPU's time for the step). Also the time to first token of the
`--prompt-tokens` prompt alone, the capture time and the graphs' memory, and whether the
modes gave the same greedy tokens. On the CPU the "graphs" mode runs the static step
uncaptured (CI's way), so the figures mean little there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _replay_ms(graphs: Any, device: str, times: int = 50) -> float | None:
    """The last step's graph replayed alone: the GPU's time for a step, without the host."""
    import torch

    captured = graphs.graphs.get(graphs.last_bucket)
    if captured is None:
        return None
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(times):
        captured[0].replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / times * 1000


def _compiled(engine: Any) -> None:
    """The static step under torch.compile(mode="reduce-overhead") instead of our own
    capture: inductor fuses the elementwise ops and records its own CUDA graphs."""
    import torch

    graphs = engine.decode_graphs
    graphs.graphs = {}
    graphs._step = torch.compile(graphs._step, mode="reduce-overhead", dynamic=False)


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    import numpy as np

    from runtime.engine import Engine, EngineConfig
    from runtime.sampling import SamplingParams

    started = time.perf_counter()
    config = EngineConfig(
        backend="torch",
        device=args.device,
        torch_forward=True,
        decode_graphs=mode != "eager",
        overlap=mode != "sync",
    )
    engine = Engine.load(args.model, config)
    out: dict[str, Any] = {"load_s": time.perf_counter() - started, "rates": {}, "tokens": {}}
    stacks: list[Any] = [()]
    if mode == "lora":  # each sequence one of 4 rank-8 adapters (bench/step_profile.py's)
        from bench.step_profile import _load_adapters

        stacks = _load_adapters(engine, 4)
    if mode == "compiled":
        _compiled(engine)
    elif engine.decode_graphs is not None:
        out["graphs"] = engine.decode_graphs.describe()
    out["first_step_s"], out["replay_ms"] = {}, {}
    vocab = engine.model.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, vocab - 100, args.prompt_tokens).tolist()
    generator = engine.new_generator()
    ttfts = []
    for i in range(4):  # time to first token of one prompt alone, cold prefix cache
        engine.prefix_cache.clear()
        generator.add(f"t{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        _sync(args.device)
        t0 = time.perf_counter()
        while len(generator):
            generator.step()
        _sync(args.device)
        ttfts.append((time.perf_counter() - t0) * 1000)
    out["ttft_ms"] = ttfts
    for n in args.sequences:
        engine.prefix_cache.clear()
        generator = engine.new_generator()
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
        length = args.prompt_tokens if n == 1 else args.batch_prompt_tokens
        for i in range(n):
            ids = rng.integers(100, vocab - 100, length).tolist()
            generator.add(f"s{i}", ids, params, adapters=stacks[i % len(stacks)])
        tokens: dict[str, list[int]] = {}
        while len(tokens) < n:  # prefill all
            for e in generator.step():
                tokens.setdefault(e.request_id, []).append(e.token_id)
        t0 = time.perf_counter()
        for e in generator.step():  # the first decode step: a compile, where there is one
            tokens[e.request_id].append(e.token_id)
        _sync(args.device)
        out["first_step_s"][n] = time.perf_counter() - t0
        for _ in range(2):
            for e in generator.step():
                tokens[e.request_id].append(e.token_id)
        _sync(args.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            for e in generator.step():
                tokens[e.request_id].append(e.token_id)
        _sync(args.device)
        seconds = time.perf_counter() - t0
        out["rates"][n] = (n * args.steps / seconds, seconds / args.steps * 1000)
        if mode == "graphs" and args.device.startswith("cuda"):
            out["replay_ms"][n] = _replay_ms(engine.decode_graphs, args.device)
        out["tokens"][n] = tokens["s0"]
        for i in range(n):
            generator.abort(f"s{i}")
    if args.device.startswith("cuda"):
        import torch

        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sequences", default="1,32,256")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--batch-prompt-tokens", type=int, default=32, help="prompts of batches > 1")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--modes", default="graphs,eager", help="graphs, eager, sync, lora, compiled")
    args = p.parse_args()
    args.sequences = [int(n) for n in args.sequences.split(",")]
    import torch

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{args.model} on {args.device} ({gpu}), torch {torch.__version__}")
    results = {}
    for mode in args.modes.split(","):
        try:
            results[mode] = r = run_mode(args, mode)
        except Exception as exc:  # a mode that fails (a compile) still lets the others report
            print(f"\n[{mode}] failed: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        print(f"\n[{mode}] load {r['load_s']:.2f} s; {r.get('graphs', '')}")
        ttfts = ", ".join(f"{t:.1f}" for t in r["ttft_ms"])
        print(f"  TTFT of a {args.prompt_tokens}-token prompt (ms): {ttfts}")
        for n, (rate, ms) in r["rates"].items():
            replay = r["replay_ms"].get(n)
            alone = f", replay alone {replay:.2f} ms" if replay else ""
            print(
                f"  {n:4d} sequences: {rate:10.1f} tok/s  {ms:7.2f} ms/step"
                f" (first decode step {r['first_step_s'][n]:.2f} s{alone})"
            )
        if "peak_mib" in r:
            print(f"  peak device memory {r['peak_mib']:.0f} MiB")
    for mode, base, what in [
        ("graphs", "eager", "graphs / eager"),
        ("graphs", "sync", "overlapped steps / steps that wait for their tokens"),
        ("lora", "graphs", "every row with a LoRA adapter / none (target >= 0.8x)"),
    ]:
        if {mode, base} <= results.keys():
            _compare(results[mode], results[base], what, args.sequences, mode != "lora")


def _compare(a: dict, b: dict, what: str, sequences: list[int], same_tokens: bool) -> None:
    print(f"\n{what}:")
    for n in sequences:
        line = f"  {n:4d} sequences: {a['rates'][n][0] / b['rates'][n][0]:6.2f}x"
        if same_tokens:  # an overlapped run's last step is still in flight at the end
            k = min(len(a["tokens"][n]), len(b["tokens"][n]))
            same = a["tokens"][n][:k] == b["tokens"][n][:k]
            line += f", first sequence's greedy tokens {'equal' if same else 'DIFFER'}"
        print(line)


if __name__ == "__main__":
    main()
