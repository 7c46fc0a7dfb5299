"""Benchmark llmq's throughput: batched decode, prefix cache, KV memory, offline batches.

    python bench/throughput.py [--quick] [--repeat 3] [--only decode,prefix,offline]
                               [--backend torch] [--backends numpy,torch]
                               [--device cpu|cuda[:N]] [--torch-forward] [--no-llama]
                               [--no-api] [--offline-requests 200] [--json FILE]

Four tables, all with SmolLM2 (`smollm2-135m-instruct`, the Q4_1 GGUF both engines load).
Our engine runs on one kernel backend, `--backend` (default torch): every in-process engine
is built with it, and the system's worker gets it as `LLMQ_BACKEND`. `--backends numpy,torch`
also runs table 1's in-process decode on each backend named (one decode table per backend;
the API column is measured on `--backend` only).

`--device cuda[:N]` (as `llmq worker --device`) runs every in-process engine's tensor
forward pass on that GPU (`EngineConfig(backend="torch", device=...)`) and gives the system's
worker `LLMQ_DEVICE`; `--torch-forward` runs the in-process engines' tensor path on the CPU
(the worker keeps its host path: a worker takes no such flag). The tensor path has one
backend, torch: numpy there exits 2, as does a device this machine cannot use (one line).
llama.cpp stays a CPU run on the CPU (a CPU build), labelled so. On CUDA the sequence counts
default to 1, 32, 64 and 256 (bench/RESULTS.md "GPU"), each in-process child reports
its peak device memory (`torch.cuda.max_memory_allocated`) and the decode table shows it.

1. Aggregate decode tokens/s with 1, 4, 16, 32 and 64 concurrent sequences (`--sequences`;
   on CUDA 1, 32, 64, 256), each with its own ~32-token prompt, greedy with EOS ignored:
   - ours in-process: `engine.new_generator()`, every sequence added (`cache_prompt=False`),
     stepped until each has its first token (prefill done), then `--steps` timed steps,
     each one batched forward pass giving every sequence a token;
   - llama.cpp (llama-cpp-python's low-level API, as llama.cpp's `batched` example):
     one context with `n_seq_max = N`, the prompts decoded in <= 512-token batches with
     a seq_id each, then `--steps` `llama_decode` calls of N tokens (one per sequence)
     with a numpy argmax over each row's logits; the KV cache is one stream per sequence
     (`kv_unified = false`), which was the faster layout here at 32 and 64 sequences
     (`--llama-kv unified` for the other);
   - through the API: N concurrent streaming `/v1/completions` clients against a running
     system (one worker, `--max-batch` 64 or the largest N): chunks that arrive while every
     stream is decoding, over that window (see bench/harness.py `steady_rate`). `--no-api`
     leaves every API figure out (this column, table 2's and table 4's): no system starts.
   Targets (bench/RESULTS.md "Engine vs llama.cpp"), judged on the torch backend: ours at
   32 sequences >= 8x ours at 1, and >= 2.0x llama.cpp at 32. On CUDA ("GPU"): ours
   at 256 >= 20x ours at 1.
2. Time to first token of a chat whose ~1,000-token system prompt is in the prefix cache
   (a second question after a first request filled it) vs cold (cache cleared), in-process
   and through the API (a fresh system prompt per repetition, asked twice, each request
   after a random 150-350 ms pause). Target >= 20x.
   Mixed lengths (`--only mixed`): 32 sequences whose prompts run from 16 to ~1,000 tokens
   (geometric), the same children for ours and llama.cpp; beside the rates, how many
   attention scores our length-sorted decode groups compute per score needed, against one
   padded group for all (runtime/models/attention.py `group_by_length`).
   Shared prefix (`--only shared`): 32 chats whose ~1,000-token system prompt is in the
   prefix cache decode together, ours only: decode groups meet the shared blocks in one
   matmul for all chats (runtime/models/attention.py `SharedRun`), against the ablation
   where each chat attends over them alone (children alternate). The ablation patches the
   host path's attention; on the tensor path (`--device cuda`, `--torch-forward`) both
   runs are the same code, so the ratio there means nothing.
3. KV memory per token held: the pool's block size / 16, and `kv_pool.bytes_in_use` against
   the tokens the sequences of table 1 hold after their decode steps.
4. An offline batch of chat requests (64 tokens each, EOS ignored): requests/s through the
   Batch API (`/v1/files` + `/v1/batches`, timed from creating the batch to seeing it
   `completed`) and in-process through one `Generator`, against the same kind of
   requests sent one at a time (a sample: the rate is requests / their total time).
   The default batch is 128 requests; `--offline-requests 1000` runs the full size.

Every in-process measurement runs in a fresh child process; ours and llama.cpp alternate,
and the repetitions are interleaved so a noisy spell hits both. Speed figures are the best
of the repetitions (median beside it). When OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are set,
our engine (in-process and the system's worker) also runs with both removed. The system's
broker is a real redis-server (the one on PATH, else the one installed with llmq), named in
the setup line; `--redis-url` names another Redis, and `--fake-broker` runs on fakeredis's
Python server, which every table's title then says.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: `bench`, `runtime` live here
    sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    MODEL,
    System,
    add_device_args,
    add_system_args,
    bench_parser,
    best,
    check_device_args,
    check_tensor_backends,
    choose_broker,
    concurrent_streams,
    device_figures,
    engine_config_args,
    header,
    http_client,
    llama_cpp_version,
    log,
    measure_per_env,
    median,
    openblas_info,
    prompt_of_tokens,
    rss_mib,
    run_child,
    script_main,
    steady_rate,
    stream,
    think,
    verdict,
)
from workers.loop_clock import PHASES  # noqa: E402

SCRIPT = Path(__file__).resolve()
SEQUENCES = (1, 4, 16, 32, 64)
CUDA_SEQUENCES = (1, 32, 64, 256)  # the figures bench/RESULTS.md "GPU" asks of a GPU
PROMPT_TOKENS = 32
DECODE_STEPS = 32
SYSTEM_PROMPT_TOKENS = 1000
MIXED_SEQUENCES = 32
SHARED_CHATS = 32
OFFLINE_TOKENS = 64
OFFLINE_REQUESTS = 128
SEQUENTIAL_SAMPLE = 3
WORKER_MAX_SEQUENCES = 64
BACKENDS = ("numpy", "torch")
DEFAULT_BACKEND = "torch"
TARGET_BACKEND = "torch"  # the backend the decode targets are judged on
TARGET_VS_SINGLE, TARGET_VS_LLAMA, TARGET_PREFIX = 8.0, 2.0, 20.0
# bench/RESULTS.md "GPU": a GPU worker's batching
CUDA_TARGET_N, CUDA_TARGET_VS_SINGLE = 256, 20.0


# ----------------------------------------------------------------------------- children


def child_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Our engine: N sequences in one batch; timed decode steps after prefill."""
    from runtime.sampling import SamplingParams

    engine = _load_engine(job)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in engine.generate(job["warmup_ids"], warm):
        pass
    prompts, steps = job["prompts"], job["steps"]
    # room for the tokens early sequences make while later ones prefill: none ends in the window
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    pool = engine.kv_pool
    kv_before, rss_before = pool.bytes_in_use, rss_mib()
    generator = engine.new_generator()
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        generator.add(f"seq-{i}", ids, params, cache_prompt=False)
    run = _prefill_then_decode(generator, len(prompts), steps)
    tokens, step_s = run.tokens, run.step_s
    prefill_s = run.decode_started - started
    # each sequence's cache holds its prompt and every sampled token but the last
    held = sum(len(p) for p in prompts) + sum(len(t) - 1 for t in tokens.values())
    return {
        "n": len(prompts),
        "decode_tps": len(prompts) * steps / sum(step_s),
        "step_ms": [s * 1000 for s in step_s],
        "prefill_s": prefill_s,
        "tokens_held": held,
        "kv_bytes_in_use": pool.bytes_in_use - kv_before,
        "kv_block_nbytes": pool.block_nbytes,
        "kv_block_size": pool.block_size,
        "rss_growth_mib": rss_mib() - rss_before,
        "first_tokens": tokens["seq-0"][:8],
        "backend": engine.backend.name,
        "kernels": engine.backend.describe(),
        "weight_kinds": engine.model.weight_kinds(),
        "openblas": openblas_info(),
        "torch_forward": engine.torch_forward,
        **device_figures(engine.device),
    }


def _load_engine(job: dict[str, Any]) -> Any:
    """The engine a child measures, on the job's kernel backend and device; room for all
    of its sequences in one batch (256 on a GPU is more than the default 64)."""
    from runtime.engine import Engine, EngineConfig

    max_sequences = max(64, len(job.get("prompts", ())))
    return Engine.load(
        job["model"], EngineConfig(max_sequences=max_sequences, **engine_config_args(job))
    )


def child_llama(job: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp with N sequences in one context, as its `batched` example drives it."""
    import llama_cpp
    import numpy as np

    prompts, steps, n = job["prompts"], job["steps"], len(job["prompts"])
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        job["model_path"].encode(), llama_cpp.llama_model_default_params()
    )
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    per_seq = max(len(p) for p in prompts) + steps + 16
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n * per_seq
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = os.cpu_count() or 1
    params.kv_unified = job["kv_unified"]
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(max(512, n), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def outputs(rows: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(rows, n_vocab))

    def prefill() -> list[int]:
        entries = [
            (tok, pos, seq, pos == len(p) - 1)
            for seq, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        first: list[int] = []
        for start in range(0, len(entries), 512):
            chunk = entries[start : start + 512]
            decode(chunk)
            wanted = sum(1 for e in chunk if e[3])
            if wanted:
                first.extend(int(t) for t in outputs(wanted).argmax(axis=1))
        return first

    def run(n_steps: int) -> tuple[float, list[float], list[int]]:
        started = time.perf_counter()
        current = prefill()
        prefill_s = time.perf_counter() - started
        positions = [len(p) for p in prompts]
        seq0 = [current[0]]
        step_s = []
        for _ in range(n_steps):
            started = time.perf_counter()
            decode([(current[s], positions[s], s, True) for s in range(n)])
            current = [int(t) for t in outputs(n).argmax(axis=1)]
            step_s.append(time.perf_counter() - started)
            positions = [p + 1 for p in positions]
            seq0.append(current[0])
        return prefill_s, step_s, seq0

    warmups = [
        [(prompts[s][0], 0, s, True) for s in range(n)],  # the shape of a decode step
        [(tok, pos, 0, pos == len(prompts[0]) - 1) for pos, tok in enumerate(prompts[0])],
    ]
    for entries in warmups * 2:  # graph allocation, first touches; then forgotten
        decode(entries)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    prefill_s, step_s, seq0 = run(steps)
    result = {
        "n": n,
        "decode_tps": n * steps / sum(step_s),
        "step_ms": [s * 1000 for s in step_s],
        "prefill_s": prefill_s,
        "kv_unified": job["kv_unified"],
        "n_ctx": llama_cpp.llama_n_ctx(ctx),
        "first_tokens": seq0[:8],
        "llama_cpp_version": llama_cpp.__version__,
    }
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return result


def child_prefix(job: dict[str, Any]) -> dict[str, Any]:
    """TTFT of a chat with a long system prompt: cold (cache cleared) vs cached."""
    from runtime.sampling import SamplingParams

    engine = _load_engine(job)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in engine.generate(engine.encode("Warm-up: a short question."), params):
        pass
    runs = []
    for rep in range(job["reps"]):
        cold = _chat_ids(engine, job["system"], f"Question {rep}: what did the keeper record?")
        warm = _chat_ids(engine, job["system"], f"Question {rep}: why did entries grow short?")
        engine.prefix_cache.clear()
        cold_s, cold_cached = _first_token(engine, cold, params)
        warm_s, warm_cached = _first_token(engine, warm, params)
        runs.append(
            {
                "cold_s": cold_s,
                "warm_s": warm_s,
                "cold_cached": cold_cached,
                "warm_cached": warm_cached,
                "prompt_tokens": len(warm),
            }
        )
    return {"runs": runs, "openblas": openblas_info()}


def _chat_ids(engine: Any, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return engine.encode_chat(messages)


def _first_token(engine: Any, ids: list[int], params: Any) -> tuple[float, int]:
    generator = engine.new_generator()
    started = time.perf_counter()
    generator.add("prefix", ids, params)  # cache_prompt defaults to True
    while True:
        events = generator.step()
        if events:
            return time.perf_counter() - started, events[0].cached_tokens


def child_shared(job: dict[str, Any]) -> dict[str, Any]:
    """N chats whose system prompt is in the prefix cache, decoding together."""
    from runtime.models import attention
    from runtime.sampling import SamplingParams

    if not job["batch_shared"]:  # the ablation: every member meets the shared prefix alone
        attention._split_shared = lambda runs: (runs, [])
    engine = _load_engine(job)
    prompts = [_chat_ids(engine, job["system"], q) for q in job["questions"]]
    for _ in engine.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0)):
        pass  # fills the prefix cache with the system prompt
    params = SamplingParams(max_tokens=job["steps"] + 32, temperature=0.0, ignore_eos=True)
    generator = engine.new_generator()
    for i, ids in enumerate(prompts):
        generator.add(f"seq-{i}", ids, params)
    run = _prefill_then_decode(generator, len(prompts), job["steps"])
    return {
        "batch_shared": job["batch_shared"],
        "decode_tps": len(prompts) * job["steps"] / sum(run.step_s),
        "prompt_tokens": sum(len(p) for p in prompts) / len(prompts),
        "cached_tokens": sum(run.cached.values()) / len(prompts),
        "first_tokens": run.tokens["seq-0"][:8],
        "openblas": openblas_info(),
    }


@dataclass
class DecodeRun:
    tokens: dict[str, list[int]]  # request id -> its tokens, prefill's first one included
    cached: dict[str, int]  # request id -> prompt tokens its prefix-cache lookup served
    decode_started: float  # perf_counter when every sequence had its first token
    step_s: list[float]  # each timed decode step


def _prefill_then_decode(generator: Any, n: int, steps: int) -> DecodeRun:
    """Step sequences `seq-0 .. seq-{n-1}` (already added) until each has its first token,
    then time `steps` decode steps, each of which must give every sequence a token."""
    run = DecodeRun({f"seq-{i}": [] for i in range(n)}, {}, 0.0, [])
    while len(run.cached) < n:  # prefill (decoding rows join as they finish it)
        for e in generator.step():
            run.cached.setdefault(e.request_id, e.cached_tokens)
            run.tokens[e.request_id].append(e.token_id)
    # the first decode step: an overlapped one (runtime/generator.py `step`) gives its
    # tokens at the next call, so each timed step reads back one step's tokens
    for e in generator.step():
        run.tokens[e.request_id].append(e.token_id)
    run.decode_started = time.perf_counter()
    for _ in range(steps):
        started = time.perf_counter()
        events = generator.step()
        run.step_s.append(time.perf_counter() - started)
        if len(events) != n or any(e.finish_reason for e in events):
            raise RuntimeError(f"a decode step gave {len(events)} tokens for {n}")
        for e in events:
            run.tokens[e.request_id].append(e.token_id)
    return run


def child_offline(job: dict[str, Any]) -> dict[str, Any]:
    """R chat requests through one Generator, then a sample of them one at a time."""
    from runtime.sampling import SamplingParams

    engine = _load_engine(job)
    params = SamplingParams(max_tokens=job["tokens"], temperature=0.0, ignore_eos=True)
    requests = [engine.encode_chat(m) for m in job["messages"]]
    for _ in engine.generate(requests[0], SamplingParams(max_tokens=2, temperature=0.0)):
        pass
    generator = engine.new_generator()
    started = time.perf_counter()
    for i, ids in enumerate(requests):
        generator.add(f"offline-{i}", ids, params)
    generated = 0
    while len(generator):
        generated += len(generator.step())
    batched_s = time.perf_counter() - started
    started = time.perf_counter()
    one_generated = 0
    for ids in requests[: job["sequential"]]:
        one_generated += sum(1 for _ in engine.generate(ids, params))
    sequential_s = time.perf_counter() - started
    return {
        "requests": len(requests),
        "batched_s": batched_s,
        "batched_tokens": generated,
        "sequential_requests": job["sequential"],
        "sequential_s": sequential_s,
        "sequential_tokens": one_generated,
        "openblas": openblas_info(),
    }


CHILDREN = {
    "ours": child_ours,
    "llama": child_llama,
    "prefix": child_prefix,
    "shared": child_shared,
    "offline": child_offline,
}


# ----------------------------------------------------------------------------- parent


def decode_runs(args: argparse.Namespace, env_name: str, env: dict[str, str]) -> dict[str, Any]:
    """Per repetition and N: ours (per backend), llama.cpp and the API, in rotating order."""
    encode = _encoder()
    path = str(_model_path())
    texts = [prompt_of_tokens(encode, PROMPT_TOKENS, tag=f"Ship {i}.") for i in range(max(args.ns))]
    ids = [encode(t) for t in texts]
    warmup = encode("Warm-up: seven quick questions about tides.")
    runs: list[dict[str, Any]] = []
    kv_layout = args.llama_kv == "unified"
    engines = [
        *args.backends,
        *(["llama"] if args.llama else []),
        *([] if args.no_api else ["api"]),
    ]
    with _system(args, env) as system:
        if system is not None:
            with http_client(system.base_url) as client:
                for _ in range(2):
                    stream(client, "/v1/completions", _completion(texts[0], 4))
        for rep in range(args.repeat):
            for n in args.ns:
                shift = (rep + args.ns.index(n)) % len(engines)
                for engine in engines[shift:] + engines[:shift]:
                    load = os.getloadavg()[0]
                    kind, backend = engine, args.backend if engine == "api" else None
                    if kind == "api":
                        bodies = [_completion(t, args.steps + 16) for t in texts[:n]]
                        streams = concurrent_streams(system.base_url, "/v1/completions", bodies)
                        rate, window, _ = steady_rate(streams)
                        result = {"decode_tps": rate, "window_s": window}
                        result["worker_loop"] = worker_loop(system.base_url)
                    elif kind == "llama":
                        job = {"prompts": ids[:n], "steps": args.steps}
                        job |= {"model_path": path, "kv_unified": kv_layout}
                        result = run_child(SCRIPT, kind, job, None)
                    else:
                        kind, backend = "ours", engine
                        job = {"prompts": ids[:n], "steps": args.steps, "model": path}
                        job |= {"warmup_ids": warmup, "backend": backend, **args.device_job}
                        result = run_child(SCRIPT, kind, job, env)
                    runs.append({"kind": kind, "n": n, "loadavg_1m": load, **result})
                    runs[-1]["backend"] = backend
                    log(
                        f"  [{env_name}] rep {rep + 1} n {n:2d} {engine:5s} load {load:4.1f}: "
                        f"{result['decode_tps']:7.1f} tok/s"
                    )
    return {"runs": runs, "kv_unified": kv_layout}


def worker_loop(base_url: str) -> dict[str, float] | None:
    """Where the worker's loop spent its last 5-10 s, per decode step (`WorkerInfo.loop`,
    workers/loop_clock.py): the API column's step against the in-process one, and what
    the rest of its tick went to. Published when its jobs end, so read just after."""
    import httpx

    time.sleep(0.2)
    workers = httpx.get(f"{base_url}/admin/workers", timeout=10).json()["data"]
    busiest = max(workers, key=lambda w: (w.get("loop") or {}).get("steps", 0), default=None)
    return None if busiest is None else busiest.get("loop")


def mixed_runs(args: argparse.Namespace, env_name: str, env: dict[str, str]) -> dict[str, Any]:
    """Decode with contexts of very different lengths: ours and llama.cpp, alternating."""
    encode = _encoder()
    path = str(_model_path())
    lengths = _mixed_lengths(MIXED_SEQUENCES)
    ids = [encode(prompt_of_tokens(encode, n, tag=f"Log {i}."))[:n] for i, n in enumerate(lengths)]
    warmup = encode("Warm-up: seven quick questions about tides.")
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        kinds = ["ours", "llama"] if args.llama else ["ours"]
        for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
            job = {"prompts": ids, "steps": args.steps}
            if kind == "ours":
                job |= {"model": path, "warmup_ids": warmup, "backend": args.backend}
                job |= args.device_job
            else:
                job |= {"model_path": path, "kv_unified": args.llama_kv == "unified"}
            result = run_child(SCRIPT, kind, job, env if kind == "ours" else None)
            runs.append({"kind": kind, **result})
            log(f"  [{env_name}] mixed rep {rep + 1} {kind:5s}: {result['decode_tps']:7.1f} tok/s")
    from runtime.models.attention import group_by_length

    final = [len(p) + args.steps for p in ids]  # keys each row sees at the last step
    grouped = sum(len(g) * max(final[i] for i in g) for g in group_by_length(final))
    return {
        "runs": runs,
        "lengths": [len(p) for p in ids],
        "needed_scores": sum(final),
        "grouped_scores": grouped,
        "one_group_scores": len(final) * max(final),
    }


def _mixed_lengths(n: int) -> list[int]:
    """n prompt lengths spread geometrically from 16 to ~1,000 tokens."""
    return [round(16 * (1000 / 16) ** (i / (n - 1))) for i in range(n)]


def prefix_runs(args: argparse.Namespace, _: str, env: dict[str, str]) -> dict[str, Any]:
    encode = _encoder()
    system = prompt_of_tokens(encode, SYSTEM_PROMPT_TOKENS, tag="You are the keeper's clerk.")
    job = {"model": MODEL, "system": system, "reps": args.prefix_reps, "backend": args.backend}
    job |= args.device_job
    ours = run_child(SCRIPT, "prefix", job, env)
    log(f"  prefix in-process: {[round(r['cold_s'] / r['warm_s'], 1) for r in ours['runs']]}")
    api: list[dict[str, float]] = []
    with _system(args, env) as sys_:
        if sys_ is None:  # --no-api
            return {"ours": ours["runs"], "api": api, "system_words": len(system.split())}
        with http_client(sys_.base_url) as client:
            stream(client, "/v1/completions", _completion("Warm-up.", 2))
            for rep in range(args.prefix_reps):
                fresh = f"Session {uuid.uuid4().hex[:8]}. {system}"  # nothing cached yet
                think()
                cold = stream(client, "/v1/chat/completions", _chat(fresh, "What was recorded?"))
                think()
                warm = stream(client, "/v1/chat/completions", _chat(fresh, "Why so short?"))
                api.append({"cold_s": cold.ttft, "warm_s": warm.ttft})
                log(f"  prefix API rep {rep + 1}: cold {cold.ttft:.3f} s, warm {warm.ttft:.3f} s")
    return {"ours": ours["runs"], "api": api, "system_words": len(system.split())}


def shared_runs(args: argparse.Namespace, env_name: str, env: dict[str, str]) -> dict[str, Any]:
    """Decode over a cached shared system prompt, with and without batching the shared run."""
    encode = _encoder()
    system = prompt_of_tokens(encode, SYSTEM_PROMPT_TOKENS, tag="You are the harbour's clerk.")
    questions = [f"Question {i}: what did ship {i} carry, and why?" for i in range(SHARED_CHATS)]
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        order = [True, False] if rep % 2 == 0 else [False, True]
        for batch_shared in order:
            job = {
                "model": MODEL,
                "system": system,
                "questions": questions,
                "steps": args.steps,
                "batch_shared": batch_shared,
                "backend": args.backend,
                **args.device_job,
            }
            result = run_child(SCRIPT, "shared", job, env)
            runs.append(result)
            label = "batched" if batch_shared else "alone"
            log(
                f"  [{env_name}] shared rep {rep + 1} {label:7s}: {result['decode_tps']:7.1f} tok/s"
            )
    return {"runs": runs}


def offline_runs(args: argparse.Namespace, _: str, env: dict[str, str]) -> dict[str, Any]:
    messages = [_offline_messages(i) for i in range(args.offline_requests)]
    out: dict[str, Any] = {}
    if not args.no_api:
        out["api"] = _offline_api(args, env, messages)
    job = {
        "model": MODEL,
        "messages": messages,
        "tokens": OFFLINE_TOKENS,
        "sequential": args.sequential,
        "backend": args.backend,
        **args.device_job,
    }
    out["ours"] = run_child(SCRIPT, "offline", job, env, timeout=3600)
    r = out["ours"]
    log(
        f"  offline in-process: {r['requests'] / r['batched_s']:.2f} req/s batched, "
        f"{r['sequential_requests'] / r['sequential_s']:.3f} req/s one at a time"
    )
    return out


def _offline_api(
    args: argparse.Namespace, env: dict[str, str], messages: list[list[dict[str, str]]]
) -> dict[str, Any]:
    lines = [
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": _chat_body(m, OFFLINE_TOKENS),
            }
        )
        for i, m in enumerate(messages)
    ]
    with _api_system(args, env) as system:
        with http_client(system.base_url) as client:
            client.post("/v1/chat/completions", json=_chat_body(messages[0], 2))  # warm
            files = {"file": ("offline.jsonl", ("\n".join(lines) + "\n").encode())}
            upload = client.post("/v1/files", data={"purpose": "batch"}, files=files)
            upload.raise_for_status()
            started = time.perf_counter()
            created = client.post(
                "/v1/batches",
                json={
                    "input_file_id": upload.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            created.raise_for_status()
            batch = _wait_batch(client, created.json()["id"])
            batch_s = time.perf_counter() - started
            counts = batch["request_counts"]
            log(f"  offline API batch: {counts} in {batch_s:.1f} s")
            started = time.perf_counter()
            for m in messages[: args.sequential]:
                client.post("/v1/chat/completions", json=_chat_body(m, OFFLINE_TOKENS))
            sequential_s = time.perf_counter() - started
    return {
        "requests": len(messages),
        "completed": counts["completed"],
        "failed": counts["failed"],
        "batch_s": batch_s,
        "server_s": batch["completed_at"] - batch["in_progress_at"],
        "sequential_requests": args.sequential,
        "sequential_s": sequential_s,
    }


def _wait_batch(client: Any, batch_id: str, timeout: float = 3600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            if batch["status"] != "completed":
                raise RuntimeError(f"the offline batch ended {batch['status']}: {batch}")
            return batch
        time.sleep(0.25)
    raise RuntimeError(f"the offline batch did not finish in {timeout}s")


def _offline_messages(i: int) -> list[dict[str, str]]:
    topics = ("tides", "lamps", "storms", "ledgers", "gulls", "ropes", "charts", "fog")
    return [
        {
            "role": "user",
            "content": f"Request {i}: write a short note about {topics[i % len(topics)]} "
            f"for ship number {i * 7 % 101}.",
        }
    ]


def _completion(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }


def _chat(system: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return _chat_body(messages, 2)


def _chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def _api_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The system's environment: the worker's backend (`LLMQ_BACKEND`) and, on a GPU, its
    device (`LLMQ_DEVICE`); the API as `llmq api` starts it (gevent: a stream is a greenlet,
    so none waits for a thread)."""
    out = {**env, "LLMQ_BACKEND": args.backend}
    if args.device != "cpu":
        out["LLMQ_DEVICE"] = args.device
    return out


def _worker_max_sequences(args: argparse.Namespace) -> int:
    """The worker's --max-batch: room for the largest N in one batch."""
    return max(WORKER_MAX_SEQUENCES, max(args.ns))


@contextlib.contextmanager
def _system(args: argparse.Namespace, env: dict[str, str]) -> Iterator[System | None]:
    """The running system the decode table's API column needs; None with --no-api."""
    if args.no_api:
        yield None
        return
    with _api_system(args, env) as system:
        yield system


def _api_system(args: argparse.Namespace, env: dict[str, str]) -> System:
    """One worker on `--backend` (and `--device`), with room for the largest N."""
    return System(
        [MODEL], args.broker, max_sequences=_worker_max_sequences(args), env=_api_env(args, env)
    )


def _model_path() -> Path:
    from runtime.registry import resolve

    return resolve(MODEL).path()


def _encoder() -> Any:
    from runtime.gguf_file import GGUFFile
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_metadata(GGUFFile(_model_path()).metadata)
    return lambda text: tokenizer.encode(text, add_special=True, parse_special=True)


# ----------------------------------------------------------------------------- report


def render(raw: dict[str, Any]) -> str:
    m = raw["meta"]
    lines = header(f"llmq throughput, {MODEL}", m)
    lines.append(_setup_line(m))
    lines.append(
        f"our backend: {m['backend']} (every in-process engine and the worker)"
        + (f"; decode tables also for {', '.join(m['backends'])}" if len(m["backends"]) > 1 else "")
    )
    for env, per_env in raw["envs"].items():
        lines += ["", f"== env {env} =="]
        if "decode" in per_env:
            for backend in m["backends"]:
                lines += _decode_block(raw, per_env["decode"], backend, m["backend"]) + [""]
            lines += _kv_block(per_env["decode"], m["backend"])
        if "mixed" in per_env:
            lines += ["", *_mixed_block(per_env["mixed"])]
        if "prefix" in per_env:
            lines += ["", *_prefix_block(per_env["prefix"])]
        if "shared" in per_env:
            lines += ["", *_shared_block(per_env["shared"])]
        if "offline" in per_env:
            lines += ["", *_offline_block(per_env["offline"])]
    return "\n".join(lines)


def _setup_line(m: dict[str, Any]) -> str:
    """llama.cpp's build and threads, and the system the API figures came from."""
    llama = (
        f"llama.cpp (CPU build, on the CPU): llama-cpp-python {m['llama_cpp_version']}, "
        f"{m['cpus']} threads"
        if m["llama_cpp_version"]
        else "llama.cpp not run (--no-llama)"
    )
    if m.get("no_api"):
        return f"{llama}; no system (--no-api): in-process figures only"
    return (
        f"{llama}; system: one worker --max-batch {m['worker_max_sequences']} "
        f"(LLMQ_BACKEND={m['backend']}{_device_env(m)}), API 2 gunicorn processes (gevent), "
        f"broker {m['broker']}, nothing saved"
    )


def _device_env(m: dict[str, Any]) -> str:
    return f", LLMQ_DEVICE={m['device']}" if m.get("device", "cpu") != "cpu" else ""


def _mixed_block(mixed: dict[str, Any]) -> list[str]:
    def rates(kind: str) -> list[float]:
        return [r["decode_tps"] for r in mixed["runs"] if r["kind"] == kind]

    ours, llama = rates("ours"), rates("llama")
    lengths = mixed["lengths"]
    lines = [
        f"decode with mixed contexts: {len(lengths)} sequences, prompts of {min(lengths)}.."
        f"{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f}); best / median",
        f"ours {best(ours):.1f} / {median(ours):.1f} tok/s"
        + (
            f"   llama.cpp {best(llama):.1f} / {median(llama):.1f} tok/s   "
            f"ours/llama {best(ours) / best(llama):.2f}x"
            if llama
            else ""
        ),
    ]
    need = mixed["needed_scores"]
    grouped, one = mixed["grouped_scores"] / need, mixed["one_group_scores"] / need
    lines.append(
        f"attention scores computed per score needed at the last step: length-sorted groups "
        f"{grouped:.2f}x, one padded group {one:.2f}x"
    )
    return lines


def _shared_block(shared: dict[str, Any]) -> list[str]:
    runs = shared["runs"]
    batched = [r["decode_tps"] for r in runs if r["batch_shared"]]
    alone = [r["decode_tps"] for r in runs if not r["batch_shared"]]
    same = len({tuple(r["first_tokens"]) for r in runs}) == 1
    return [
        f"decode over a shared cached prefix: {SHARED_CHATS} chats, ~{SYSTEM_PROMPT_TOKENS}-token "
        f"system prompt ({runs[0]['prompt_tokens']:.0f} prompt tokens per chat, "
        f"{runs[0]['cached_tokens']:.0f} from the cache); best / median",
        f"shared run batched {best(batched):.1f} / {median(batched):.1f} tok/s   "
        f"each chat alone {best(alone):.1f} / {median(alone):.1f} tok/s   "
        f"batched/alone {best(batched) / best(alone):.2f}x   "
        f"first 8 greedy tokens {'identical' if same else 'DIFFERENT'} both ways",
    ]


def _decode_block(
    raw: dict[str, Any], decode: dict[str, Any], backend: str, api_backend: str
) -> list[str]:
    """The decode table of one backend; llama.cpp's column is shared by all, the API's
    belongs to the backend the worker ran (`api_backend`)."""
    runs = [
        r
        for r in decode["runs"]
        if r["kind"] == "llama"
        or r.get("backend") == backend
        or (r["kind"] == "api" and backend == api_backend)
    ]

    def rates(kind: str, n: int) -> list[float]:
        return [r["decode_tps"] for r in runs if r["kind"] == kind and r["n"] == n]

    def cell(kind: str, n: int) -> str:
        values = rates(kind, n)
        return f"{best(values):.1f} / {median(values):.1f}" if values else "-"

    ns = sorted({r["n"] for r in runs})
    has_llama = any(r["kind"] == "llama" for r in runs)
    layout = "unified" if decode.get("kv_unified") else "one per sequence"
    first = next(r for r in runs if r["kind"] == "ours")
    kernels = "; ".join(f"{k}: {v}" for k, v in first["kernels"].items())
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(first["weight_kinds"].items()))
    path = "tensor forward pass" if first.get("torch_forward") else "host forward pass"
    peaks = {r["n"]: r["peak_device_mib"] for r in runs if r.get("peak_device_mib")}
    lines = [
        f"backend {backend} ({kernels}; weights {{{kinds}}})",
        f"ours in-process: {path} on {first.get('device', 'cpu')}"
        + ("; peak dev MiB = torch.cuda.max_memory_allocated of the child" if peaks else ""),
        f"aggregate decode tok/s, {PROMPT_TOKENS}-token prompts, {raw['meta']['steps']} steps "
        f"after prefill (best / median of {raw['meta']['repeat']})"
        + (f"; llama.cpp KV cache: {layout}" if has_llama else ""),
        f"{'seqs':>4} {'ours in-process':>17} {'via API':>17} {'llama.cpp (CPU)':>17} "
        f"{'ours/1 seq':>10} {'ours/llama':>10} {'API/ours':>8} {'ms/step':>8}"
        + (f" {'peak dev MiB':>12}" if peaks else ""),
    ]
    single = best(rates("ours", ns[0]))
    for n in ns:
        ours = best(rates("ours", n))
        llama = best(rates("llama", n)) if has_llama else float("nan")
        api = best(rates("api", n)) if rates("api", n) else float("nan")
        lines.append(
            f"{n:>4} {cell('ours', n):>17} {cell('api', n):>17} {cell('llama', n):>17} "
            f"{_times(ours / single):>10} {_times(ours / llama):>10} {_times(api / ours):>8} "
            f"{n / ours * 1000:>8.1f}" + (f" {peaks[n]:>12.0f}" if n in peaks else "")
        )
    lines += _loop_lines(runs, ns)
    if 32 in ns and backend != TARGET_BACKEND:
        lines.append(f"targets are judged on the {TARGET_BACKEND} backend, not {backend}")
    elif 32 in ns:
        vs_single = best(rates("ours", 32)) / single
        lines.append(
            f"targets at 32 sequences: >= {TARGET_VS_SINGLE:.0f}x single stream: "
            f"{verdict(vs_single >= TARGET_VS_SINGLE)} ({vs_single:.2f}x)"
        )
        if has_llama:
            vs_llama = best(rates("ours", 32)) / best(rates("llama", 32))
            lines[-1] += (
                f"; >= {TARGET_VS_LLAMA:.1f}x llama.cpp: {verdict(vs_llama >= TARGET_VS_LLAMA)} "
                f"({vs_llama:.2f}x)"
            )
    if CUDA_TARGET_N in ns and peaks and backend == TARGET_BACKEND:
        vs_single = best(rates("ours", CUDA_TARGET_N)) / single
        lines.append(
            f"GPU target at {CUDA_TARGET_N} sequences: >= "
            f"{CUDA_TARGET_VS_SINGLE:.0f}x single stream: "
            f"{verdict(vs_single >= CUDA_TARGET_VS_SINGLE)} ({vs_single:.2f}x)"
        )
    agree = [
        r["n"]
        for r in runs
        if r["kind"] == "ours"
        and any(
            q["kind"] == "llama" and q["n"] == r["n"] and q["first_tokens"] == r["first_tokens"]
            for q in runs
        )
    ]
    if has_llama:
        lines.append(
            "first 8 greedy tokens of sequence 0 identical in both engines at N = "
            f"{sorted(set(agree)) or 'none'}"
        )
    return lines


def _loop_lines(runs: list[dict[str, Any]], ns: list[int]) -> list[str]:
    """The worker's tick through the API, ms per decode step by part (the last repetition
    of each N; workers/loop_clock.py), beside the in-process step."""
    lines = []
    for n in ns:
        loops = [r["worker_loop"] for r in runs if r["kind"] == "api" and r["n"] == n]
        loop = next((x for x in reversed(loops) if x and x.get("steps")), None)
        if loop is None:
            continue
        parts = ", ".join(
            f"{phase} {loop[f'{phase}_ms']:.2f}"
            for phase in PHASES  # in the tick's order
        )
        lines.append(
            f"  worker loop via API at {n}: ms per step: {parts} "
            f"({loop['steps']} steps in {loop['seconds']:.1f} s)"
        )
    if lines:
        lines.insert(0, "the worker's loop through the API (its last 5-10 s at each N):")
    return lines


def _times(ratio: float) -> str:
    return "-" if ratio != ratio else f"{ratio:.2f}x"  # NaN: a column that was not measured


def _kv_block(decode: dict[str, Any], backend: str) -> list[str]:
    ours = [r for r in decode["runs"] if r["kind"] == "ours" and r["backend"] == backend]
    per_token = ours[0]["kv_block_nbytes"] / ours[0]["kv_block_size"]
    host = not ours[0].get("torch_forward")  # the host path's pool is float32
    what = "float32 K and V of every layer" if host else "K and V of every layer, pool dtype"
    llama = (
        f"; llama.cpp's default f16 cache: {per_token / 2:.0f} B/token, allocated for the "
        "whole n_ctx up front"
        if host
        else ""
    )
    lines = [
        f"KV memory per token: {per_token:.0f} B ({per_token / 1024:.1f} KiB, {what}; "
        f"blocks of {ours[0]['kv_block_size']} tokens, "
        f"{ours[0]['kv_block_nbytes'] / 2**20:.2f} MiB each){llama}",
        f"{'seqs':>4} {'tokens held':>11} {'bytes_in_use':>13} {'B/token held':>13} "
        f"{'overhead':>9} {'RSS growth MiB':>15}",
    ]
    seen = set()
    for r in ours:
        if r["n"] in seen:
            continue
        seen.add(r["n"])
        held, used = r["tokens_held"], r["kv_bytes_in_use"]
        lines.append(
            f"{r['n']:>4} {held:>11} {used / 2**20:>10.2f} MiB {used / held:>13.0f} "
            f"{used / held / per_token - 1:>8.1%} {r['rss_growth_mib']:>15.1f}"
        )
    lines.append(
        "overhead = partly filled last blocks; RSS growth also counts activations and "
        "allocator caches of the batch, so it only bounds the KV pages from above"
    )
    return lines


def _prefix_block(prefix: dict[str, Any]) -> list[str]:
    lines = [
        f"time to first token, chat with a ~{SYSTEM_PROMPT_TOKENS}-token system prompt: cold "
        "(nothing cached) vs its prefix cached by a previous request; best / median"
    ]

    def row(name: str, runs: list[dict[str, Any]], extra: str = "") -> str:
        cold = [r["cold_s"] * 1000 for r in runs]
        warm = [r["warm_s"] * 1000 for r in runs]
        ratio = best(cold, False) / best(warm, False)
        return (
            f"{name:<12} cold {best(cold, False):7.1f} / {median(cold):7.1f} ms   cached "
            f"{best(warm, False):6.1f} / {median(warm):6.1f} ms   {ratio:5.1f}x faster  "
            f">= {TARGET_PREFIX:.0f}x: {verdict(ratio >= TARGET_PREFIX)}{extra}"
        )

    ours = prefix["ours"]
    cached = ours[0]["warm_cached"]
    lines.append(
        row(
            "in-process",
            ours,
            f"   ({ours[0]['prompt_tokens']} prompt tokens, {cached} from the cache)",
        )
    )
    if prefix.get("api"):
        lines.append(row("via API", prefix["api"]))
    return lines


def _offline_block(offline: dict[str, Any]) -> list[str]:
    lines = [f"offline batch of chat requests, {OFFLINE_TOKENS} tokens each (EOS ignored)"]
    for name, r, batch_s in (
        ("Batch API", offline.get("api"), "batch_s"),
        ("in-process", offline.get("ours"), "batched_s"),
    ):
        if r is None:
            continue
        batched = r["requests"] / r[batch_s]
        one = r["sequential_requests"] / r["sequential_s"]
        lines.append(
            f"{name:<11} {r['requests']} requests batched: {batched:6.2f} req/s "
            f"({batched * OFFLINE_TOKENS:6.1f} tok/s, {r[batch_s]:.1f} s); one at a time "
            f"({r['sequential_requests']} sent): {one:.3f} req/s; batched/sequential "
            f"{batched / one:.1f}x"
        )
    return lines


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="1 repetition, fewer steps and requests")
    p.add_argument("--repeat", type=int, help="decode repetitions (default 2, quick 1)")
    p.add_argument("--steps", type=int, help=f"timed decode steps (default {DECODE_STEPS})")
    p.add_argument("--only", default="decode,mixed,prefix,shared,offline", help="parts to run")
    p.add_argument(
        "--sequences",
        help=f"values of N (default {','.join(map(str, SEQUENCES))}; on CUDA "
        f"{','.join(map(str, CUDA_SEQUENCES))})",
    )
    add_device_args(p)
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=DEFAULT_BACKEND,
        help=f"our kernel backend, in-process and in the worker (default {DEFAULT_BACKEND})",
    )
    p.add_argument(
        "--backends",
        help="decode table: in-process decode on each of these too (comma-separated; "
        "--backend is always run; default: --backend alone)",
    )
    p.add_argument("--no-llama", dest="llama", action="store_false", help="skip llama.cpp")
    p.add_argument(
        "--llama-kv",
        choices=("per-seq", "unified"),
        default="per-seq",
        help="llama.cpp KV layout (default per-seq: the faster here at 32 and 64 sequences)",
    )
    p.add_argument("--no-api", action="store_true", help="in-process only: no system is started")
    p.add_argument("--offline-requests", type=int, help=f"default {OFFLINE_REQUESTS}")
    add_system_args(p, CHILDREN)
    args = p.parse_args(argv)
    choose_broker(p, args, needed=not args.no_api)
    if args.child:
        return args
    check_device_args(p, args)
    args.device_job = {"device": args.device, "torch_forward": args.tensor_path}
    args.repeat = args.repeat or (1 if args.quick else 2)
    args.steps = args.steps or (12 if args.quick else DECODE_STEPS)
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    default_ns = CUDA_SEQUENCES if args.device != "cpu" else SEQUENCES
    args.ns = [int(n) for n in (args.sequences or ",".join(map(str, default_ns))).split(",")]
    names = args.backends.split(",") if args.backends else [args.backend]
    args.backends = [b.strip() for b in names if b.strip()]
    if any(b not in BACKENDS for b in args.backends):
        p.error(f"--backends must name some of {', '.join(BACKENDS)}, got {args.backends}")
    if args.backend not in args.backends:
        args.backends.append(args.backend)
    check_tensor_backends(p, args, args.backends)
    if args.llama and llama_cpp_version() is None:
        p.error("llama-cpp-python is not installed: install it, or pass --no-llama")
    args.offline_requests = args.offline_requests or (48 if args.quick else OFFLINE_REQUESTS)
    args.sequential = 2 if args.quick else SEQUENTIAL_SAMPLE
    args.prefix_reps = 3 if args.quick else 4
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    parts = {
        "decode": decode_runs,
        "mixed": mixed_runs,
        "prefix": prefix_runs,
        "shared": shared_runs,
        "offline": offline_runs,
    }
    raw: dict[str, Any] = {"envs": measure_per_env(args, parts, args.only)}
    raw["meta"] = {
        "repeat": args.repeat,
        "steps": args.steps,
        "backend": args.backend,
        "backends": args.backends,
        "llama_cpp_version": llama_cpp_version() if args.llama else None,
        "device": args.device,
        "torch_forward": args.tensor_path,
        "worker_max_sequences": _worker_max_sequences(args),
        "no_api": args.no_api,
    }
    return raw


main = script_main(parse_args, CHILDREN, measure, render)

if __name__ == "__main__":
    sys.exit(main())
