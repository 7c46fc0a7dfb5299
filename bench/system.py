"""Benchmark the job system around the engine: API + Redis + worker + SSE.

    python bench/system.py [--quick] [--rounds 3] [--jobs 300] [--json FILE]

It starts its own system (a real redis-server on a free port: the one on PATH, else the one
installed with llmq; `--redis-url` names another Redis, `--fake-broker` fakeredis's Python
server, and then every table says so; `llmq worker` processes and `llmq api`, as `llmq serve`
runs them), names its broker in the setup line, and prints three tables:

1. One client, SmolLM2: time to first token and decode tokens/s of a streaming
   `/v1/completions` request (`ignore_eos`, greedy, `cache_prompt: false`) against the engine
   in-process on the same prompt and max_tokens (`Engine.new_generator()`, one sequence, same
   `cache_prompt=False`), measured in alternating rounds of the same run. TTFT through the
   API is from sending the POST to receiving the first text chunk; decode is the tokens
   after the first (`usage`) over the time from the first chunk to the last (a token whose
   text is empty sends no chunk). Each API request waits a random 150-350 ms first, so it
   reaches the idle worker at a random point of its polling loop. Goals: the queue path adds
   < 10 ms to TTFT at p50 and costs < 5% of decode tokens/s (best of the runs, as
   `bench/engine.py` judges speed).
2. Jobs per second with a no-op engine and 1, 2, 4 workers: the "no-op engine" is a tiny
   random llama GGUF (`tests/tiny_models.py`, 2 layers of width 64; a forward pass costs
   well under a millisecond) served under its path, with `max_tokens: 1`, so a job is all
   system: HTTP submit, RQ enqueue, claim, lease, engine step, stream write, RQ bookkeeping.
   Jobs go in with `Prefer: respond-async` from 8 client threads. `submit` is the API's
   202 rate; `drain` queues the jobs while workers are suspended (`rq suspend`), resumes
   them, and divides by (last finished_at - first started_at) of the job records;
   `end-to-end` submits while workers run: jobs / (last finished - first POST).
3. Aggregate decode tokens/s with 1, 8 and 32 concurrent streaming clients (threads), each
   with its own prompt: chunks that arrive while every stream is decoding (after the last
   stream's first token, before the first stream's last) over that window.

4. llama.cpp's own server on the same GGUF (`llama-server -np 32 -c 16384 -t <cores>`, built
   by `make llama-server` or named by `LLAMA_SERVER`; skipped with a line where it is not
   built), the same clients as table 3, and llmq's ratio to it: targets 1 client >= 1.0x,
   32 clients >= 1.5x, TTFT p50 at 32 clients <= llama-server's.

Every in-process measurement runs in a fresh child process. Other processes share this
machine and only slow runs down, so speed figures are the best of the runs (median beside
it) and TTFT differences use p50s. The worker runs with `--max-batch 64`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: `bench`, `runtime` live here
    sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    MODEL,
    System,
    add_system_args,
    bench_parser,
    best,
    choose_broker,
    concurrent_streams,
    header,
    http_client,
    log,
    measure_per_env,
    median,
    openblas_info,
    prompt_of_tokens,
    run_child,
    script_main,
    steady_rate,
    stream,
    think,
    verdict,
)

SCRIPT = Path(__file__).resolve()
PROMPT_TOKENS = 128
MAX_TOKENS = 48
REPS_PER_ROUND = 4
CLIENTS = (1, 8, 32)
CLIENT_MAX_TOKENS = 64
WORKER_COUNTS = (1, 2, 4)
NOOP_MODEL = "tiny-noop"
SUBMIT_THREADS = 8
SUBMIT_ATTEMPTS = 5
TARGET_TTFT_MS = 10.0
TARGET_DECODE_COST = 0.05
WORKER_MAX_SEQUENCES = 64
NOOP_MAX_SEQUENCES = 8  # `llmq worker`'s default
LLAMA_SERVER_SLOTS, LLAMA_SERVER_CONTEXT = 32, 16384
TARGET_VS_LLAMA = {1: 1.0, 32: 1.5}  # llmq steady tok/s / llama-server's, per client count


# ----------------------------------------------------------------------------- child


def child_single(job: dict[str, Any]) -> dict[str, Any]:
    """The engine in-process: one sequence at a time, as the worker would run it alone."""
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    engine = Engine.load(job["model"])
    ids = engine.encode(job["prompt"])
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in engine.generate(engine.encode("Warm-up: three short questions."), warm):
        pass
    runs = []
    for rep in range(job["reps"]):
        generator = engine.new_generator()
        started = time.perf_counter()
        generator.add(f"single-{rep}", ids, params, cache_prompt=False)
        stamps = []
        while len(generator):
            stamps.extend(time.perf_counter() for _ in generator.step())
        runs.append(
            {
                "ttft_s": stamps[0] - started,
                "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                "tokens": len(stamps),
            }
        )
    return {"prompt_tokens": len(ids), "runs": runs, "openblas": openblas_info()}


CHILDREN = {"single": child_single}


# ----------------------------------------------------------------------------- system runs


def single_client(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Rounds of in-process runs (a child) and API runs, alternating, on one prompt."""
    prompt = prompt_of_tokens(_encoder(), PROMPT_TOKENS)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    job = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "reps": args.reps}
    ours: list[dict[str, Any]] = []
    api: list[dict[str, Any]] = []
    prompt_tokens = 0
    system = _model_system(args, env)
    with system:
        with http_client(system.base_url) as client:
            for _ in range(2):  # loads the model in the worker, warms both paths
                stream(client, "/v1/completions", {**body, "max_tokens": 4})
            for rnd in range(args.rounds):
                for kind in ("ours", "api") if rnd % 2 == 0 else ("api", "ours"):
                    load = os.getloadavg()[0]
                    if kind == "ours":
                        result = run_child(SCRIPT, "single", job, env)
                        prompt_tokens = result["prompt_tokens"]
                        ours.extend(result["runs"])
                        runs = result["runs"]
                    else:
                        runs = []
                        for _ in range(args.reps):
                            think()
                            s = stream(client, "/v1/completions", body)
                            if s.error or s.completion_tokens != args.max_tokens:
                                raise RuntimeError(f"API stream failed: {s.error or s}")
                            runs.append({"ttft_s": s.ttft, "decode_tps": s.decode_tps})
                        api.extend(runs)
                    ttft = median([r["ttft_s"] for r in runs]) * 1000
                    tps = best([r["decode_tps"] for r in runs])
                    log(
                        f"  single round {rnd + 1} {kind:4s} load {load:4.1f}: "
                        f"ttft p50 {ttft:.1f} ms, decode best {tps:.2f} tok/s"
                    )
    return {"prompt_tokens": prompt_tokens, "ours": ours, "api": api}


def _model_system(args: argparse.Namespace, env: dict[str, str]) -> System:
    """The system the model's figures come from: one worker, `--max-batch 64`."""
    return System(
        [MODEL],
        args.broker,
        max_sequences=WORKER_MAX_SEQUENCES,
        env=env,
        redis_args=args.redis_args,
    )


def aggregate_clients(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    encode = _encoder()
    system = _model_system(args, env)
    with system:
        return _clients(system.base_url, args, encode, MODEL)


def _clients(base_url: str, args: argparse.Namespace, encode: Any, model: str) -> dict[str, Any]:
    """Concurrent streaming clients against an OpenAI-compatible server, per client count:
    steady and overall tokens/s and TTFT p50, one entry per repetition."""
    out: dict[str, Any] = {}
    with http_client(base_url) as client:  # warm-up
        stream(client, "/v1/completions", {**_client_body(encode, 0, 4), "model": model})
    for rep in range(args.client_reps):
        for n in args.clients:
            bodies = [
                {**_client_body(encode, i, args.client_max_tokens), "model": model}
                for i in range(n)
            ]
            load = os.getloadavg()[0]
            streams = concurrent_streams(base_url, "/v1/completions", bodies)
            rate, window, in_window = steady_rate(streams)
            total = sum(s.completion_tokens or len(s.chunks) for s in streams)
            wall = max(s.chunks[-1] for s in streams) - min(s.sent for s in streams)
            ttft = median([s.ttft for s in streams])
            out.setdefault(str(n), []).append(
                {
                    "steady_tps": rate,
                    "window_s": window,
                    "window_tokens": in_window,
                    "overall_tps": total / wall,
                    "ttft_p50_s": ttft,
                    "loadavg_1m": load,
                }
            )
            log(
                f"  {base_url} clients {n:3d} rep {rep + 1} load {load:4.1f}: steady "
                f"{rate:.1f} tok/s over {window:.1f} s, overall {total / wall:.1f} tok/s"
            )
    return out


def llama_server_binary() -> Path | None:
    """`LLAMA_SERVER`, else what `make llama-server` builds; None where neither exists."""
    path = Path(os.environ.get("LLAMA_SERVER", REPO / "build/llama.cpp/bin/llama-server"))
    return path if path.is_file() else None


def llama_server_clients(args: argparse.Namespace, binary: Path) -> dict[str, Any]:
    """The same clients against `llama-server -np 32 -c 16384 -t <cores>` on the same GGUF
    (llama.cpp's continuous batching: 32 slots of 512 tokens each)."""
    import socket
    import subprocess

    from runtime.registry import resolve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(binary), "-m", str(resolve(MODEL).path()), "-np", str(LLAMA_SERVER_SLOTS)]
    argv += ["-c", str(LLAMA_SERVER_CONTEXT), "-t", str(os.cpu_count() or 1)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with http_client(base_url) as client:
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except Exception:  # not listening yet
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not start ({argv})")
                time.sleep(0.2)
        return _clients(base_url, args, _encoder(), MODEL)
    finally:
        server.terminate()
        server.wait(30)


def _client_body(encode: Any, i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt_of_tokens(encode, 48, tag=f"Reader {i} asks about the ledger."),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }


def jobs_per_second(args: argparse.Namespace) -> dict[str, Any]:
    from tests.tiny_models import write_tiny_llama

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="llmq-bench-") as tmp:
        model = write_tiny_llama(Path(tmp) / f"{NOOP_MODEL}.gguf")
        for workers in args.worker_counts:
            system = System(
                [str(model)],
                args.broker,
                workers=workers,
                max_sequences=NOOP_MAX_SEQUENCES,
                redis_args=args.redis_args,
            )
            with system:
                conn = system.redis()
                _submit_and_wait(system, conn, 4 * workers)  # every worker loads the model
                runs = []
                for rep in range(args.job_reps):
                    load = os.getloadavg()[0]
                    drain = _drain(system, conn, args.jobs)
                    e2e = _end_to_end(system, conn, args.jobs)
                    runs.append({**drain, **e2e, "loadavg_1m": load})
                    log(
                        f"  no-op jobs, {workers} worker(s), rep {rep + 1}, load {load:4.1f}: "
                        f"submit {drain['submit_rate']:.0f}/s, drain {drain['drain_rate']:.0f}"
                        f"/s, end-to-end {e2e['e2e_rate']:.0f}/s"
                    )
                out[str(workers)] = runs
                conn.close()
    return out


def _drain(system: System, conn: Any, n_jobs: int) -> dict[str, float]:
    """Queue `n_jobs` while the workers are suspended, then time how fast they empty it."""
    from rq.suspension import resume, suspend

    suspend(conn)
    time.sleep(1.2)  # workers look at the suspension flag once a second
    started = time.perf_counter()
    ids = _submit(system, n_jobs)
    submit_s = time.perf_counter() - started
    resume(conn)
    records = _wait_finished(conn, ids)
    first_start = min(float(r[b"started_at"]) for r in records)
    last_finish = max(float(r[b"finished_at"]) for r in records)
    return {"submit_rate": n_jobs / submit_s, "drain_rate": n_jobs / (last_finish - first_start)}


def _end_to_end(system: System, conn: Any, n_jobs: int) -> dict[str, float]:
    first_post = time.time()
    ids = _submit(system, n_jobs)
    records = _wait_finished(conn, ids)
    last_finish = max(float(r[b"finished_at"]) for r in records)
    return {"e2e_rate": n_jobs / (last_finish - first_post)}


def _submit_and_wait(system: System, conn: Any, n_jobs: int) -> None:
    _wait_finished(conn, _submit(system, n_jobs))


def _submit(system: System, n_jobs: int) -> list[str]:
    """POST `n_jobs` async completions from `SUBMIT_THREADS` threads; their job ids. A 429 or
    503 is retried after a pause, as a client would (never seen with redis-server here)."""
    body = {"model": NOOP_MODEL, "prompt": "the harbour", "max_tokens": 1, "temperature": 0}
    ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    share, extra = divmod(n_jobs, SUBMIT_THREADS)
    per_thread = [share + (i < extra) for i in range(SUBMIT_THREADS)]
    with http_client(system.base_url, SUBMIT_THREADS) as client:

        def post() -> str:
            for _ in range(SUBMIT_ATTEMPTS):
                response = client.post(
                    "/v1/completions", json=body, headers={"Prefer": "respond-async"}
                )
                if response.status_code == 202:
                    return response.json()["id"]
                if response.status_code not in (429, 503):
                    break
                time.sleep(0.2)
            raise RuntimeError(f"submit: {response.status_code} {response.text[:200]}")

        def run(count: int) -> None:
            try:
                for _ in range(count):
                    job_id = post()
                    with lock:
                        ids.append(job_id)
            except Exception as exc:  # reported below, with the count
                errors.append(str(exc))

        threads = [threading.Thread(target=run, args=(c,)) for c in per_thread]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if len(ids) != n_jobs:
        raise RuntimeError(f"only {len(ids)} of {n_jobs} jobs were accepted: {errors[:1]}")
    return ids


def _wait_finished(conn: Any, ids: Sequence[str], timeout: float = 300) -> list[dict]:
    """Poll the job records (one pipeline per look) until every job has finished."""
    from workers import keys

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(keys.job(job_id))
            records = pipe.execute()
        statuses = {r.get(b"status") for r in records}
        if statuses == {b"finished"}:
            return records
        if statuses & {b"failed", b"cancelled"}:
            raise RuntimeError(f"some no-op jobs did not finish: {statuses}")
        time.sleep(0.05)
    raise RuntimeError(f"{len(ids)} no-op jobs did not finish in {timeout}s")


def _encoder() -> Any:
    from runtime.gguf_file import GGUFFile
    from runtime.registry import resolve
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_metadata(GGUFFile(resolve(MODEL).path()).metadata)
    return lambda text: tokenizer.encode(text, add_special=True, parse_special=True)


# ----------------------------------------------------------------------------- report


def render(raw: dict[str, Any]) -> str:
    """The printed tables (parts left out with --skip are absent)."""
    lines = header("llmq job system (API + Redis + worker + SSE)", raw["meta"])
    lines.append(
        f"worker: --max-batch {WORKER_MAX_SEQUENCES} "
        f"(no-op jobs: the default {NOOP_MAX_SEQUENCES}); API: "
        "`llmq api` (2 gunicorn processes, gevent: a stream is a greenlet); broker: "
        f"{raw['meta']['broker']}, nothing saved"
        + (f", --hz {raw['meta']['redis_hz']}" if raw["meta"].get("redis_hz") else "")
    )
    for env, per_env in raw["envs"].items():
        lines += ["", f"== env {env} =="]
        if "single" in per_env:
            lines += _single_block(raw, per_env["single"])
        if "clients" in per_env:
            lines += ["", *_clients_block(per_env["clients"])]
    if "llama_server" in raw:
        lines += ["", *_llama_server_block(raw)]
    if "jobs" in raw:
        lines += ["", *_jobs_block(raw)]
    return "\n".join(lines)


def _llama_server_block(raw: dict[str, Any]) -> list[str]:
    theirs = raw["llama_server"]
    if theirs is None:
        return ["llama-server: not built (`make llama-server`, or LLAMA_SERVER=path): skipped"]
    ours = next(iter(raw["envs"].values())).get("clients")
    lines = [
        f"llama-server -np {LLAMA_SERVER_SLOTS} -c {LLAMA_SERVER_CONTEXT} on the same file, "
        "the same clients (best steady tok/s, median TTFT p50)",
        *_clients_block(theirs),
    ]
    if not ours:
        return lines
    lines.append("llmq (`llmq serve` as above) / llama-server:")
    for n, runs in sorted(theirs.items(), key=lambda kv: int(kv[0])):
        if n not in ours:
            continue
        ratio = best([r["steady_tps"] for r in ours[n]]) / best([r["steady_tps"] for r in runs])
        ttft_ours = median([r["ttft_p50_s"] for r in ours[n]]) * 1000
        ttft_theirs = median([r["ttft_p50_s"] for r in runs]) * 1000
        target = TARGET_VS_LLAMA.get(int(n))
        judged = f" (target >= {target}x: {verdict(ratio >= target)})" if target else ""
        lines.append(
            f"  {n:>3} clients: {ratio:.2f}x tok/s{judged}; TTFT p50 {ttft_ours:.0f} vs "
            f"{ttft_theirs:.0f} ms"
        )
    return lines


def _single_block(raw: dict[str, Any], single: dict[str, Any]) -> list[str]:
    ours, api = single["ours"], single["api"]

    def ms(runs: list[dict[str, Any]], pick: Any) -> float:
        return pick([r["ttft_s"] for r in runs]) * 1000

    p50_diff = ms(api, median) - ms(ours, median)
    tps_ours, tps_api = best([r["decode_tps"] for r in ours]), best([r["decode_tps"] for r in api])
    cost = 1 - tps_api / tps_ours

    def row(name: str, a: str, b: str, c: str, target: str = "") -> str:
        return f"{name:<30} {a:>14} {b:>14} {c:>12}  {target}".rstrip()

    def tps(runs: list[dict[str, Any]]) -> str:
        values = [r["decode_tps"] for r in runs]
        return f"{best(values):.2f} / {median(values):.2f}"

    m = raw["meta"]
    return [
        f"one client, {MODEL}: {single['prompt_tokens']}-token prompt, {m['max_tokens']} "
        f"tokens, greedy, ignore_eos, cache_prompt off; {len(ours)} runs each, "
        f"{m['rounds']} alternating rounds",
        row("", "in-process", "via API", "API - ours", "target"),
        row(
            "TTFT p50 (ms)",
            f"{ms(ours, median):.1f}",
            f"{ms(api, median):.1f}",
            f"{p50_diff:+.1f} ms",
            f"< {TARGET_TTFT_MS:.0f} ms added: {verdict(p50_diff < TARGET_TTFT_MS)}",
        ),
        row(
            "TTFT best (ms)",
            f"{ms(ours, min):.1f}",
            f"{ms(api, min):.1f}",
            f"{ms(api, min) - ms(ours, min):+.1f} ms",
        ),
        row(
            "decode tok/s (best / median)",
            tps(ours),
            tps(api),
            f"{tps_api / tps_ours:.3f}x",
            f"cost < {TARGET_DECODE_COST:.0%}: {verdict(cost < TARGET_DECODE_COST)} "
            f"(cost {cost:.1%})",
        ),
    ]


def _clients_block(clients: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        f"aggregate decode through the API, concurrent streaming clients ({CLIENT_MAX_TOKENS} "
        "tokens each, own ~48-token prompt each); best / median of the repetitions",
        f"{'clients':>7} {'steady tok/s':>16} {'per client':>11} {'vs 1 client':>12} "
        f"{'all tok / wall':>15} {'TTFT p50 ms':>12}",
    ]
    one = best([r["steady_tps"] for r in clients[min(clients, key=int)]])
    for n, runs in sorted(clients.items(), key=lambda kv: int(kv[0])):
        steady = [r["steady_tps"] for r in runs]
        overall = best([r["overall_tps"] for r in runs])
        ttft = median([r["ttft_p50_s"] for r in runs]) * 1000
        lines.append(
            f"{n:>7} {best(steady):>7.1f} / {median(steady):>6.1f} {best(steady) / int(n):>11.2f} "
            f"{best(steady) / one:>11.2f}x {overall:>15.1f} {ttft:>12.0f}"
        )
    return lines


def _jobs_block(raw: dict[str, Any]) -> list[str]:
    jobs = raw["jobs"]
    m = raw["meta"]
    lines = [
        f"jobs per second through the queue, no-op engine (tiny random llama GGUF, "
        f"max_tokens 1), {m['jobs']} jobs per run, {SUBMIT_THREADS} submitting threads; "
        "best / median",
        f"{'workers':>7} {'submit (202/s)':>16} {'drain (jobs/s)':>16} "
        f"{'end-to-end (jobs/s)':>20} {'drain vs 1':>11}",
    ]
    first = best([r["drain_rate"] for r in jobs[min(jobs, key=int)]])

    def cell(runs: list[dict[str, Any]], key: str) -> str:
        values = [r[key] for r in runs]
        return f"{best(values):.0f} / {median(values):.0f}"

    for n, runs in sorted(jobs.items(), key=lambda kv: int(kv[0])):
        drain = best([r["drain_rate"] for r in runs])
        lines.append(
            f"{n:>7} {cell(runs, 'submit_rate'):>16} {cell(runs, 'drain_rate'):>16} "
            f"{cell(runs, 'e2e_rate'):>20} {drain / first:>10.2f}x"
        )
    return lines


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="fewer rounds, jobs and tokens")
    p.add_argument("--rounds", type=int, help="single-client rounds (default 3, quick 1)")
    p.add_argument("--jobs", type=int, help="no-op jobs per run (default 300, quick 100)")
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: single,clients,llama-server,jobs",
    )
    p.add_argument(
        "--redis-hz",
        type=int,
        help="start redis-server with --hz N (default: its own, 10: blocking-call timeouts "
        "fire on its 100 ms cron, which sets how often an idle worker looks at its queues)",
    )
    add_system_args(p, CHILDREN)
    args = p.parse_args(argv)
    if args.redis_hz and (args.fake_broker or args.redis_url):
        p.error("--redis-hz sets the redis-server this bench starts; there is none here")
    choose_broker(p, args, needed=True)
    args.redis_args = ["--hz", str(args.redis_hz)] if args.redis_hz else []
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.reps = 3 if args.quick else REPS_PER_ROUND
    args.max_tokens = 24 if args.quick else MAX_TOKENS
    args.jobs = args.jobs or (100 if args.quick else 300)
    args.job_reps = 1 if args.quick else 2
    args.client_reps = 1 if args.quick else 2
    args.client_max_tokens = 32 if args.quick else CLIENT_MAX_TOKENS
    args.clients = CLIENTS
    args.worker_counts = WORKER_COUNTS
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    parts = {
        "single": lambda a, _name, env: single_client(a, env),
        "clients": lambda a, _name, env: aggregate_clients(a, env),
    }
    raw: dict[str, Any] = {"envs": measure_per_env(args, parts, set(parts) - args.skip)}
    if "llama-server" not in args.skip:
        binary = llama_server_binary()
        raw["llama_server"] = llama_server_clients(args, binary) if binary else None
    if "jobs" not in args.skip:
        raw["jobs"] = jobs_per_second(args)
    raw["meta"] = {
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "jobs": args.jobs,
        "redis_hz": args.redis_hz,
    }
    return raw


main = script_main(parse_args, CHILDREN, measure, render)

if __name__ == "__main__":
    sys.exit(main())
