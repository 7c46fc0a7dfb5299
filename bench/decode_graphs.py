"""Decode from captured CUDA graphs against the eager step, side by side in one run.

    python bench/decode_graphs.py [--device cuda] [--model smollm2-135m-instruct]
                                  [--sequences 1,32,256] [--prompt-tokens 512] [--steps 64]
                                  [--batch-prompt-tokens 32] [--modes graphs,eager]

For each mode (graphs: runtime/decode_graphs.py, captured at load on a GPU; eager: the same
engine with `decode_graphs=False`) it loads the model, then for each batch size prefills
that many greedy sequences with random prompts (`--prompt-tokens` alone, else
`--batch-prompt-tokens`; EOS ignored) and times `--steps` decode steps: tokens a second
and ms a step; also the time to first token of the `--prompt-tokens` prompt alone. It
prints the capture time and the graphs' device memory, and checks that both modes
produced the same tokens (greedy). On the CPU the "graphs" mode runs the static step
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


def run_mode(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    import numpy as np

    from runtime.engine import Engine, EngineConfig
    from runtime.sampling import SamplingParams

    started = time.perf_counter()
    engine = Engine.load(
        args.model,
        EngineConfig(backend="torch", device=args.device, torch_forward=True, decode_graphs=graphs),
    )
    out: dict[str, Any] = {"load_s": time.perf_counter() - started, "rates": {}, "tokens": {}}
    if engine.decode_graphs is not None:
        out["graphs"] = engine.decode_graphs.describe()
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
            generator.add(f"s{i}", ids, params)
        tokens: dict[str, list[int]] = {}
        while any(len(v) < 2 for v in tokens.values()) or len(tokens) < n:  # prefill all
            for e in generator.step():
                tokens.setdefault(e.request_id, []).append(e.token_id)
        _sync(args.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            for e in generator.step():
                tokens[e.request_id].append(e.token_id)
        _sync(args.device)
        seconds = time.perf_counter() - t0
        out["rates"][n] = (n * args.steps / seconds, seconds / args.steps * 1000)
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
    p.add_argument("--modes", default="graphs,eager")
    args = p.parse_args()
    args.sequences = [int(n) for n in args.sequences.split(",")]
    import torch

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{args.model} on {args.device} ({gpu}), torch {torch.__version__}")
    results = {}
    for mode in args.modes.split(","):
        results[mode] = r = run_mode(args, graphs=mode == "graphs")
        print(f"\n[{mode}] load {r['load_s']:.2f} s; {r.get('graphs', '')}")
        ttfts = ", ".join(f"{t:.1f}" for t in r["ttft_ms"])
        print(f"  TTFT of a {args.prompt_tokens}-token prompt (ms): {ttfts}")
        for n, (rate, ms) in r["rates"].items():
            print(f"  {n:4d} sequences: {rate:10.1f} tok/s  {ms:7.2f} ms/step")
        if "peak_mib" in r:
            print(f"  peak device memory {r['peak_mib']:.0f} MiB")
    if {"graphs", "eager"} <= results.keys():
        g, e = results["graphs"], results["eager"]
        print("\ngraphs / eager:")
        for n in args.sequences:
            same = g["tokens"][n] == e["tokens"][n]
            print(
                f"  {n:4d} sequences: {g['rates'][n][0] / e['rates'][n][0]:6.2f}x, "
                f"first sequence's greedy tokens {'equal' if same else 'DIFFER'}"
            )


if __name__ == "__main__":
    main()
