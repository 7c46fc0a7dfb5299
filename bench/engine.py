"""Benchmark llmq's engine, on each kernel backend, against llama.cpp (llama-cpp-python) on
the same GGUF file.

    python bench/engine.py [--models smollm2-135m-instruct,gemma-3-270m]
                           [--backends numpy,torch] [--device cpu|cuda[:N]] [--torch-forward]
                           [--no-llama] [--repeat 3] [--quick] [--json FILE]

Per model it prints prefill speed (512-token prompt), single-stream decode speed at ~600
tokens of context, load time and peak RSS for each of our backends (`numpy`: float32 and
OpenBLAS, the reference; `torch`: weights kept quantized, torch's CPU kernels) and for
llama.cpp, with each backend's ratio to llama.cpp; above the tables, each backend's kernel
plan (`engine.backend.describe()`) and, per model, how many weights each kernel got and the
bytes they take. The memory bandwidth numpy reaches on this machine, and the float32 decode
limit it implies for the numpy backend, are printed for reference.

Devices: `--device cuda[:N]` (as `llmq worker --device`) runs our engine's tensor
forward pass on that GPU (`EngineConfig(backend="torch", device=...)`): weights, KV pool and
activations on the device. `--torch-forward` runs the same tensor path on the CPU (CI's way
to test the GPU's code). The tensor path has one backend, torch (`--backends` defaults to it
there; numpy exits 2). A device this machine cannot use exits 2 at once with one line.
llama.cpp stays a CPU run on the CPU (the installed build is a CPU build), labelled so. On
CUDA each child also reports its peak device memory (`torch.cuda.max_memory_allocated`),
printed under peak RSS, and the device (`runtime.devices.describe_device`). The GPU
targets are not judged here: see bench/RESULTS.md "GPU" for them and for
the comparison with the CPU worker (the same script with `--device cpu --backends torch`).
`--no-llama` skips llama.cpp (where llama-cpp-python is not installed); without it the
ratios and the kernel layer's targets are not computed.

Targets (bench/RESULTS.md "Engine vs llama.cpp"), judged on the torch backend's best figures:
- SmolLM2-135M: decode >= 1.0x llama.cpp (moonshot 1.5x), prefill >= 3x llama.cpp,
  load <= 0.5 s, peak RSS <= 2x llama.cpp's;
- Gemma 3 270M: decode >= 0.8x llama.cpp, prefill >= 1.5x llama.cpp.

How it measures, and why:
- Every measurement runs in a fresh child process, so peak RSS is that of a process that
  only loads one model and runs the measurements (the child reads its own `VmHWM`),
  and so the OpenBLAS environment can be changed for that child alone.
- Load time is the model's load alone: our child imports its backend's libraries first
  (`runtime.kernels.get_backend`, which imports torch for the torch backend), as llama.cpp's
  child imports `llama_cpp` before its timer starts. Peak RSS counts those libraries.
- Both engines get the same token ids (our tokenizer's) and a short warm-up on other tokens
  (a server answers warm). The warm-up shares no prefix with the measured prompts, and the
  512-token prompt is the first to be prefilled with those tokens, so no prefix cache can
  shorten it (the decode prompt, measured after it, may hit the cache: only its decode
  steps are timed).
- Prefill is the time to the first token: the whole prompt in one batch plus the LM head
  on the last position and one greedy sample (argmax over llama.cpp's last logits).
- Decode: prefill `DECODE_CONTEXT` tokens (a model with a shorter context: prompts fitted
  to it, `prompt_ids`), then time `--decode-tokens` greedy steps, each
  one forward pass over one token plus an argmax; EOS is ignored.
- Other processes share this machine and only ever slow a run down, so the best of the
  repetitions is the headline figure and targets are judged on it; the median is printed
  beside it to show the spread. Our backends' runs and llama.cpp's take turns (the order
  rotates per repetition), so a noisy spell hits all of them.
- `OPENBLAS_CORETYPE` / `OPENBLAS_L2_SIZE` can make OpenBLAS pick a slower sgemm kernel.
  When either is set, our engine (every backend: attention runs in numpy on both) and the
  bandwidth probe also run in children with both removed, and the table shows both.
  llama.cpp does not use OpenBLAS: it runs as-is only.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: `runtime` lives in the repo root
    sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    OPENBLAS_VARS,
    add_device_args,
    check_device_args,
    check_tensor_backends,
    child_main,
    commit,
    device_figures,
    engine_config_args,
    env_variants,
    llama_cpp_version,
    openblas_info,
    openblas_note,
    peak_rss_mib,
    run_child,
    verdict,
)

SCRIPT = Path(__file__).resolve()
DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
PREFILL_TOKENS = 512
DECODE_CONTEXT = 540  # prompt before decoding; with 64 generated tokens, ~600 of context
DECODE_TOKENS = 64
QUICK_DECODE_TOKENS = 16
WARMUP_TOKENS, WARMUP_GENERATED = 16, 4
BANDWIDTH_MIB = 512
BANDWIDTH_REPS = 10
MIB = 2**20
BACKENDS = ("numpy", "torch")
TARGET_BACKEND = "torch"  # the backend the kernel layer's targets are judged on


@dataclass(frozen=True)
class Target:
    """A bound on one figure of `TARGET_BACKEND`: its ratio to llama.cpp's (`vs_llama`), or
    the figure itself; `at_least` for speeds, else at most. `moonshot` is printed, not
    judged."""

    bound: float
    at_least: bool = True
    vs_llama: bool = True
    unit: str = "x"  # of the figure, when not a ratio
    moonshot: float | None = None

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound

    def text(self) -> str:
        op = ">=" if self.at_least else "<="
        return (
            f"{op} {self.bound:g}x llama.cpp"
            if self.vs_llama
            else f"{op} {self.bound:g} {self.unit}"
        )

    def value_text(self, value: float) -> str:
        return f"{value:.2f}x" if self.vs_llama else f"{value:.2f} {self.unit}"


TARGETS: dict[str, dict[str, Target]] = {
    "smollm2-135m-instruct": {
        "prefill_tps": Target(3.0),
        "decode_tps": Target(1.0, moonshot=1.5),
        "load_s": Target(0.5, at_least=False, vs_llama=False, unit="s"),
        "peak_rss_mib": Target(2.0, at_least=False),
    },
    "gemma-3-270m": {
        "prefill_tps": Target(1.5),
        "decode_tps": Target(0.8),
    },
}

# Prose written for this bench; repeated in numbered sections until long enough.
_TEXT = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls argued over "
    "the nets, and the baker on the corner opened her shutters to let out the smell of warm "
    "bread. Children ran along the sea wall counting ships, while the old ferryman repaired "
    "a rope and explained, to anyone who would listen, why the weather would change by noon."
)
_WARMUP_TEXT = "Warm-up: seven quick questions about lighthouses, tides and maps."


# ----------------------------------------------------------------------------- children


def child_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Load our engine on one backend, warm up, time prefill and decode; one process, one
    model."""
    from runtime.devices import is_cuda
    from runtime.engine import Engine, EngineConfig
    from runtime.kernels import get_backend
    from runtime.sampling import SamplingParams

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    rss_before = peak_rss_mib()
    started = time.perf_counter()
    get_backend(job["backend"])  # imports its libraries (torch): not part of the load
    if is_cuda(job["device"]):  # nor is creating the CUDA context
        import torch

        torch.zeros(1, device=job["device"])
    import_s = time.perf_counter() - started
    rss_imported = peak_rss_mib()
    config = EngineConfig(**engine_config_args(job))
    started = time.perf_counter()
    engine = Engine.load(job["model_path"], config)  # a path is a model id: llama.cpp's file
    load_s = time.perf_counter() - started

    for _ in engine.generate(job["warmup_ids"], greedy(WARMUP_GENERATED)):
        pass

    events = engine.generate(job["prefill_ids"], greedy(1))
    started = time.perf_counter()
    next(events)  # arrives once the whole prompt is in and one token is sampled
    ttft_s = time.perf_counter() - started
    for _ in events:
        pass

    stamps: list[float] = []
    tokens: list[int] = []
    for event in engine.generate(job["decode_ids"], greedy(job["decode_tokens"] + 1)):
        stamps.append(time.perf_counter())
        tokens.append(event.token_id)
    return {
        "backend": engine.backend.name,
        "kernels": engine.backend.describe(),
        "weight_kinds": engine.model.weight_kinds(),
        "weight_bytes": int(engine.model.nbytes),  # as the backend keeps them
        "import_s": import_s,
        "load_s": load_s,
        "engine_load_seconds": engine.load_seconds,
        "ttft_s": ttft_s,
        "decode_s": stamps[-1] - stamps[0],  # decode_tokens steps after the first token
        "tokens": tokens,
        "rss_before_load_mib": rss_before,
        "rss_after_import_mib": rss_imported,
        "peak_rss_mib": peak_rss_mib(),
        "openblas": openblas_info(),
        "torch_forward": engine.torch_forward,
        **device_figures(engine.device),
    }


def child_llama(job: dict[str, Any]) -> dict[str, Any]:
    """The same measurements through llama-cpp-python, with the configuration of the brief."""
    import llama_cpp
    import numpy as np

    rss_before = peak_rss_mib()
    n_threads = os.cpu_count() or 1
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=job["model_path"],
        n_ctx=2048,
        n_threads=n_threads,
        n_batch=512,
        verbose=False,
    )
    load_s = time.perf_counter() - started
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        # logits_all=False keeps only the last position's logits, and only in the context
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    def prefill(ids: Sequence[int]) -> int:
        llm.reset()  # n_tokens = 0: eval drops every cached position before evaluating
        llm.eval(ids)
        return argmax_last()

    token = prefill(job["warmup_ids"])
    for _ in range(WARMUP_GENERATED - 1):
        llm.eval([token])
        token = argmax_last()

    started = time.perf_counter()
    prefill(job["prefill_ids"])
    ttft_s = time.perf_counter() - started

    tokens = [prefill(job["decode_ids"])]
    started = time.perf_counter()
    for _ in range(job["decode_tokens"]):
        llm.eval([tokens[-1]])
        tokens.append(argmax_last())
    decode_s = time.perf_counter() - started
    return {
        "load_s": load_s,
        "ttft_s": ttft_s,
        "decode_s": decode_s,
        "tokens": tokens,
        "n_threads": n_threads,
        "llama_cpp_version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "rss_before_load_mib": rss_before,
        "peak_rss_mib": peak_rss_mib(),
    }


def child_bandwidth(job: dict[str, Any]) -> dict[str, Any]:
    """Bytes per second numpy streams from memory: float32 matrix @ vector, and np.sum.

    The matrix-vector product is what decode does with every weight, so it sets the limit;
    `np.sum` runs on one thread and is printed only for reference.
    """
    import numpy as np

    cols = 4096
    rows = job["mib"] * MIB // 4 // cols
    matrix = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    vector = np.ones(cols, np.float32)

    def best_seconds(run: Callable[[], object]) -> float:
        run()  # first touch, thread start-up
        times = []
        for _ in range(job["reps"]):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    return {
        "bytes": int(matrix.nbytes),
        "shape": [rows, cols],
        "matvec_gbps": matrix.nbytes / best_seconds(lambda: matrix @ vector) / 1e9,
        "sum_gbps": matrix.nbytes / best_seconds(matrix.sum) / 1e9,
        "openblas": openblas_info(),
    }


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ours": child_ours,
    "llama": child_llama,
    "bandwidth": child_bandwidth,
}


def prompt_ids(model_path: Path, decode_tokens: int) -> dict[str, list[int]]:
    """Token ids for both engines, from our tokenizer: the prompt starts with BOS if the
    model wants one, and the measured prompts are prefixes of one long text. A model whose
    context is shorter than PREFILL_TOKENS / DECODE_CONTEXT + the decoded tokens (the tiny
    architecture fixtures of tests/fixtures/arch/: 256) gets prompts that fit it: half its
    context to prefill, the rest less the decoded tokens as the decode's context."""
    from runtime.gguf_file import GGUFFile
    from runtime.tokenizer import Tokenizer

    gguf = GGUFFile(model_path)
    tokenizer = Tokenizer.from_metadata(gguf.metadata)
    context = int(gguf.metadata.get(f"{gguf.architecture}.context_length", 1 << 20))
    prefill = min(PREFILL_TOKENS, context // 2)
    decode_context = min(DECODE_CONTEXT, context - decode_tokens - 2)
    need = max(prefill, decode_context)
    text, section = "", 0
    ids: list[int] = []
    while len(ids) < need:
        section += 1
        text += f"\n\n{section}. {_TEXT}"
        ids = tokenizer.encode(text, add_special=True, parse_special=True)
    warmup = tokenizer.encode(_WARMUP_TEXT, add_special=True, parse_special=True)
    return {
        "prefill_ids": ids[:prefill],
        "decode_ids": ids[:decode_context],
        "warmup_ids": warmup[:WARMUP_TOKENS],
    }


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every child run, interleaved: per repetition, bandwidth, then per model each of our
    backends and llama.cpp, in an order that rotates per repetition."""
    from runtime.registry import resolve

    variants = env_variants()
    models: dict[str, dict[str, Any]] = {}
    for model_id in args.models:
        path = resolve(model_id).path()
        models[model_id] = {"path": str(path), "file_bytes": path.stat().st_size}
        models[model_id]["jobs"] = {
            "model_path": str(path),
            "decode_tokens": args.decode_tokens,
            **prompt_ids(path, args.decode_tokens),
        }
        models[model_id]["prefill_tokens"] = len(models[model_id]["jobs"]["prefill_ids"])
        models[model_id]["decode_context"] = len(models[model_id]["jobs"]["decode_ids"])
    runs: list[dict[str, Any]] = []

    def measure(engine: str, variant: str, model: str | None, job: dict[str, Any]) -> None:
        kind = engine if engine in ("llama", "bandwidth") else "ours"
        load = os.getloadavg()[0]  # kept with the figures: a busy machine explains outliers
        result = run_child(SCRIPT, kind, job, dict(variants)[variant])
        if "prefill_ids" in job:
            result["prefill_tokens"] = len(job["prefill_ids"])
        run = {"kind": kind, "engine": engine, "env": variant, "model": model, "loadavg_1m": load}
        runs.append({**run, **result})
        label = f"{engine:9s} {variant:6s} {model or '':24s} load {load:4.1f}"
        print(f"  [{len(runs):3d}] {label} {_short(kind, result)}", file=sys.stderr, flush=True)

    bandwidth_job = {"mib": args.bandwidth_mib, "reps": args.bandwidth_reps}
    engines = [*args.backends, *(["llama"] if args.llama else [])]
    device_job = {"device": args.device, "torch_forward": args.tensor_path}
    for rep in range(args.repeat):
        print(f"repetition {rep + 1}/{args.repeat}", file=sys.stderr, flush=True)
        for name, _ in variants:
            measure("bandwidth", name, None, bandwidth_job)
        for model_id, model in models.items():
            shift = rep % len(engines)
            for engine in engines[shift:] + engines[:shift]:
                if engine == "llama":
                    measure(engine, variants[0][0], model_id, model["jobs"])
                    continue
                for name, _ in variants:
                    job = {**model["jobs"], **device_job, "backend": engine}
                    measure(engine, name, model_id, job)
    return {
        "variants": [name for name, _ in variants],
        "backends": list(args.backends),
        "models": models,
        "runs": runs,
    }


def _short(kind: str, r: dict[str, Any]) -> str:
    if kind == "bandwidth":
        return f"matvec {r['matvec_gbps']:.1f} GB/s, sum {r['sum_gbps']:.1f} GB/s"
    decode = (len(r["tokens"]) - 1) / r["decode_s"]
    return (
        f"load {r['load_s']:.2f}s, prefill {r['prefill_tokens'] / r['ttft_s']:.1f} tok/s, "
        f"decode {decode:.2f} tok/s, rss {r['peak_rss_mib']:.0f} MiB"
    )


# ----------------------------------------------------------------------------- report


def prompt_sizes(raw: dict[str, Any], model: str) -> tuple[int, int]:
    """The prefill prompt's tokens and the decode's context for `model`: its own where
    `prompt_ids` fitted them to a short context, else the run's (a file saved before they
    were kept per model)."""
    info, meta = raw["models"][model], raw["meta"]
    return (
        info.get("prefill_tokens", meta.get("prefill_tokens", PREFILL_TOKENS)),
        info.get("decode_context", meta.get("decode_context", DECODE_CONTEXT)),
    )


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Best and median of every figure, ratios to llama.cpp and target verdicts, per env,
    model and backend; each backend's kernel plan."""
    runs = raw["runs"]

    def pick(engine: str, env: str, model: str | None) -> list[dict[str, Any]]:
        return [
            r for r in runs if r["engine"] == engine and r["env"] == env and r["model"] == model
        ]

    def stats(values: list[float], higher_is_better: bool) -> dict[str, float]:
        best = max(values) if higher_is_better else min(values)
        return {"best": best, "median": statistics.median(values), "n": len(values)}

    def engine_stats(rs: list[dict[str, Any]], prefill_tokens: int) -> dict[str, Any]:
        return {
            "prefill_tps": stats([prefill_tokens / r["ttft_s"] for r in rs], True),
            "ttft_s": stats([r["ttft_s"] for r in rs], False),
            "decode_tps": stats([(len(r["tokens"]) - 1) / r["decode_s"] for r in rs], True),
            "load_s": stats([r["load_s"] for r in rs], False),
            "peak_rss_mib": {"best": max(r["peak_rss_mib"] for r in rs), "n": len(rs)},
        }

    def peak_device(rs: list[dict[str, Any]]) -> dict[str, float] | None:
        peaks = [r["peak_device_mib"] for r in rs if r.get("peak_device_mib") is not None]
        return {"best": max(peaks), "n": len(peaks)} if peaks else None

    kernels = {}
    for backend in raw["backends"]:
        first = next(r for r in runs if r["engine"] == backend)
        kernels[backend] = first["kernels"]
    summary: dict[str, Any] = {"kernels": kernels, "envs": {}}
    first_env = raw["variants"][0]
    for env in raw["variants"]:
        bw = pick("bandwidth", env, None)
        per_env: dict[str, Any] = {
            "openblas": bw[0]["openblas"],
            "matvec_gbps": stats([r["matvec_gbps"] for r in bw], True),
            "sum_gbps": stats([r["sum_gbps"] for r in bw], True),
            "models": {},
        }
        for model in raw["models"]:
            llama_runs = pick("llama", first_env, model)
            prefill_tokens = prompt_sizes(raw, model)[0]
            model_stats = functools.partial(engine_stats, prefill_tokens=prefill_tokens)
            llama = model_stats(llama_runs) if llama_runs else None
            m: dict[str, Any] = {"llama": llama, "backends": {}}
            for backend in raw["backends"]:
                rs = pick(backend, env, model)
                tokens = llama_runs[0]["tokens"] if llama_runs else None
                m["backends"][backend] = _backend_summary(rs, model_stats, llama, tokens)
                m["backends"][backend]["peak_device_mib"] = peak_device(rs)
                m["backends"][backend]["device"] = rs[0].get("device", "cpu")
            if "numpy" in m["backends"]:  # the float32 limit, for reference
                numpy = m["backends"]["numpy"]
                limit = per_env["matvec_gbps"]["best"] * 1e9 / numpy["weight_bytes"]
                m["numpy_decode_limit_tps"] = limit
                m["numpy_decode_of_limit"] = numpy["stats"]["decode_tps"]["best"] / limit
            if TARGET_BACKEND in m["backends"] and model in TARGETS and llama:
                m["targets"] = _judge(m["backends"][TARGET_BACKEND], TARGETS[model])
            per_env["models"][model] = m
        summary["envs"][env] = per_env
    return summary


def _backend_summary(
    rs: list[dict[str, Any]],
    engine_stats: Callable[[list[dict[str, Any]]], dict[str, Any]],
    llama: dict[str, Any] | None,
    llama_tokens: list[int] | None,
) -> dict[str, Any]:
    """One backend's figures on one model, and their ratios to llama.cpp's best (none
    when llama.cpp was not run)."""
    s = engine_stats(rs)
    return {
        "stats": s,
        "vs_llama": {key: s[key]["best"] / llama[key]["best"] for key in s} if llama else {},
        "weight_kinds": rs[0]["weight_kinds"],
        "weight_bytes": rs[0]["weight_bytes"],
        "import_s": {"best": min(r["import_s"] for r in rs)},
        "greedy_tokens_agreeing": _common_prefix(rs[0]["tokens"], llama_tokens)
        if llama_tokens
        else None,
        "greedy_tokens_total": len(rs[0]["tokens"]),
    }


def _judge(backend: dict[str, Any], targets: dict[str, Target]) -> dict[str, Any]:
    out = {}
    for key, target in targets.items():
        value = backend["vs_llama"][key] if target.vs_llama else backend["stats"][key]["best"]
        out[key] = {
            "target": target.text(),
            "value": value,
            "value_text": target.value_text(value),
            "met": target.met(value),
            "moonshot": target.moonshot,
            "moonshot_met": None if target.moonshot is None else value >= target.moonshot,
        }
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _fmt(s: dict[str, float], digits: int) -> str:
    if "median" not in s:
        return f"{s['best']:.{digits}f}"
    return f"{s['best']:.{digits}f} / {s['median']:.{digits}f}"


def render(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    """The printed table: kernel plans, then one block per environment variant and model."""
    lines: list[str] = []
    meta = raw["meta"]
    llama = (
        f"vs llama.cpp {meta['llama_cpp_version']} (CPU build, on the CPU)"
        if meta["llama_cpp_version"]
        else "(llama.cpp not run)"
    )
    path = "tensor forward pass" if meta.get("torch_forward") else "host forward pass"
    lines.append(
        f"llmq engine ({', '.join(raw['backends'])} backend"
        f"{'s' if len(raw['backends']) > 1 else ''}; {path} on {_device(raw)}) {llama} | "
        f"{meta['cpus']} CPUs | repeat {meta['repeat']} | commit {meta['commit']} | "
        f"{meta['date']}"
    )
    start_load, end_load = meta["loadavg_1m_start_end"]
    lines.append(
        f"wall {meta['wall_s']:.0f} s; load average (1 min) {start_load:.2f} at start, "
        f"{end_load:.2f} at end; per-run loads in --json"
    )
    lines.append(
        "cells: best / median of the repetitions; ratio = backend / llama.cpp on best; "
        f"targets (kernel layer) judged on the {TARGET_BACKEND} backend's best"
    )
    lines.append(
        "prefill = the prompt's tokens / time to first token, which includes the LM head on the "
        "last position and one greedy sample; decode = greedy steps after the first token; "
        "load excludes importing the backend's libraries (shown below it, untimed in load)"
    )
    lines.append(openblas_note())
    versions = f"numpy {meta['numpy']}" + (f", torch {meta['torch']}" if meta.get("torch") else "")
    lines.append(f"kernel plans (engine.backend.describe(); {versions}):")
    for backend, plan in summary["kernels"].items():
        lines.append(f"  {backend}: " + "; ".join(f"{k}: {v}" for k, v in plan.items()))
    for env, per_env in summary["envs"].items():
        ob = per_env["openblas"]
        lines.append("")
        lines.append(
            f"== env {env}: numpy OpenBLAS {ob.get('version')} kernel {ob.get('architecture')}"
            f", {ob.get('num_threads')} threads =="
        )
        lines.append(
            f"numpy bandwidth ({raw['meta']['bandwidth_mib']} MiB float32, reference): "
            f"matvec {_fmt(per_env['matvec_gbps'], 1)} GB/s, "
            f"np.sum (1 thread) {_fmt(per_env['sum_gbps'], 1)} GB/s"
        )
        for model, m in per_env["models"].items():
            lines.extend(_model_block(raw, model, m))
    return "\n".join(lines)


def _model_block(raw: dict[str, Any], model: str, m: dict[str, Any]) -> list[str]:
    info = raw["models"][model]
    backends, llama = m["backends"], m["llama"]
    targets = m.get("targets", {})
    decode_tokens = raw["meta"]["decode_tokens"]
    prefill_tokens, ctx = prompt_sizes(raw, model)
    on_cpu = all(b["device"] == "cpu" for b in backends.values())

    def row(name: str, cells: list[str], ratios: list[str], target: str) -> str:
        out = f"{name:<32}" + "".join(f" {c:>16}" for c in cells)
        return (out + "".join(f" {r:>11}" for r in ratios) + f"  {target}").rstrip()

    def line(name: str, key: str, digits: int) -> str:
        cells = [_fmt(b["stats"][key], digits) for b in backends.values()]
        if not llama:
            return row(name, cells, [], "")
        ratios = [f"{b['vs_llama'][key]:.2f}x" for b in backends.values()]
        return row(name, [*cells, _fmt(llama[key], digits)], ratios, _target_cell(targets, key))

    weights = "; ".join(
        f"{name} {_kinds(b['weight_kinds'])} {b['weight_bytes'] / 1e6:.0f} MB"
        for name, b in backends.items()
    )
    imports = [f"{b['import_s']['best']:.2f}" for b in backends.values()]
    # llama.cpp is a CPU build: on a GPU run its column is the CPU comparison
    llama_name = "llama.cpp" if on_cpu else "llama.cpp (CPU)"
    lines = [
        "",
        f"{model}: {Path(info['path']).name} ({info['file_bytes'] / 1e6:.0f} MB file)",
        f"  weights per kernel and resident bytes: {weights}",
        row(
            "",
            [*backends, *([llama_name] if llama else [])],
            [f"{name}/llama" for name in backends] if llama else [],
            f"target ({TARGET_BACKEND})" if targets else "",
        ),
        line(f"prefill {prefill_tokens} tok (tok/s)", "prefill_tps", 1),
        line("  time to first token (s)", "ttft_s", 3),
        line(f"decode {decode_tokens} tok @ {ctx}+ ctx (tok/s)", "decode_tps", 2),
        line("load (s)", "load_s", 2),
        row("  library import, not in load (s)", [*imports, *(["-"] if llama else [])], [], ""),
        line("peak RSS (MiB)", "peak_rss_mib", 0),
    ]
    peaks = [b["peak_device_mib"] for b in backends.values()]
    if any(peaks):
        cells = [f"{p['best']:.0f}" if p else "-" for p in peaks]
        lines.append(row("peak device memory (MiB)", cells, [], "torch.cuda.max_memory_allocated"))
    if "numpy_decode_limit_tps" in m:
        lines.append(
            f"  numpy f32 decode limit {m['numpy_decode_limit_tps']:.2f} tok/s "
            f"(= {backends['numpy']['weight_bytes'] / 1e6:.0f} MB per token / best matvec "
            f"bandwidth); numpy reaches {m['numpy_decode_of_limit']:.2f} of it (reference)"
        )
    lines.extend(_agreement_and_targets(model, backends, llama, targets))
    return lines


def _agreement_and_targets(
    model: str, backends: dict[str, Any], llama: dict[str, Any] | None, targets: dict[str, Any]
) -> list[str]:
    """The greedy-token agreement line and why targets were not judged, if they were not."""
    if not llama:
        return ["  llama.cpp not run (--no-llama): no ratios, the kernel targets not judged"]
    agree = ", ".join(
        f"{name} {b['greedy_tokens_agreeing']} of {b['greedy_tokens_total']}"
        for name, b in backends.items()
    )
    lines = [f"  greedy tokens identical to llama.cpp's (first run): {agree}"]
    if model not in TARGETS:
        lines.append("  no targets for this model")
    elif not targets:
        lines.append(f"  targets not judged: the {TARGET_BACKEND} backend was not run")
    return lines


def _device(raw: dict[str, Any]) -> str:
    """The device our children ran on, as they described it (e.g. the GPU's name)."""
    for run in raw["runs"]:
        if run["kind"] == "ours":
            return run.get("device", "cpu")
    return raw["meta"].get("device", "cpu")


def _kinds(kinds: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) + "}"


def _target_cell(targets: dict[str, Any], key: str) -> str:
    t = targets.get(key)
    if t is None:
        return ""
    cell = f"{t['target']}: {verdict(t['met'])} ({t['value_text']})"
    if t["moonshot"] is not None:
        cell += f"; moonshot {t['moonshot']:g}x: {verdict(t['moonshot_met'])}"
    return cell


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated ids")
    p.add_argument(
        "--backends",
        help="our kernel backends, comma-separated (default numpy,torch; torch alone on the "
        "tensor forward pass)",
    )
    add_device_args(p)
    p.add_argument("--no-llama", dest="llama", action="store_false", help="skip llama.cpp")
    p.add_argument("--repeat", type=int, default=None, help="repetitions (default 3, quick 1)")
    p.add_argument("--quick", action="store_true", help="1 repetition, 16 decode tokens")
    p.add_argument("--json", type=Path, help="also write the raw figures and summary here")
    p.add_argument("--bandwidth-mib", type=int, default=BANDWIDTH_MIB)
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    check_device_args(p, args)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    default = TARGET_BACKEND if args.tensor_path else ",".join(BACKENDS)
    args.backends = [b.strip() for b in (args.backends or default).split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown or not args.backends:
        p.error(f"--backends must name some of {', '.join(BACKENDS)}, got {args.backends}")
    check_tensor_backends(p, args, args.backends)
    if args.llama and llama_cpp_version() is None:
        p.error("llama-cpp-python is not installed: install it, or pass --no-llama")
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.decode_tokens = QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS
    args.bandwidth_reps = 3 if args.quick else BANDWIDTH_REPS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(CHILDREN, args.child)
    from importlib.metadata import version

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    raw = run_all(args)
    raw["meta"] = {
        "date": date,
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": version("numpy"),
        "torch": version("torch") if "torch" in args.backends else None,
        "backends": args.backends,
        "llama_cpp_version": llama_cpp_version() if args.llama else None,
        "device": args.device,
        "torch_forward": args.tensor_path,
        "openblas_env": {k: os.environ.get(k) for k in OPENBLAS_VARS},
        "repeat": args.repeat,
        "decode_tokens": args.decode_tokens,
        "decode_context": DECODE_CONTEXT,
        "prefill_tokens": PREFILL_TOKENS,
        "bandwidth_mib": args.bandwidth_mib,
        "loadavg_1m_start_end": [load_at_start, os.getloadavg()[0]],
        "wall_s": time.perf_counter() - started,
    }
    summary = summarize(raw)
    print(render(raw, summary))
    if args.json:
        args.json.write_text(json.dumps({"raw": raw, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
