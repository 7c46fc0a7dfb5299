"""What the system benches share: a running llmq (a broker, bench/broker.py, + API + workers),
a streaming HTTP client that timestamps every chunk, child processes per measurement, run
metadata, and a script's options and report (`bench_parser`, `run_script`).

`bench/system.py` and `bench/throughput.py` import this as `bench.harness` (the repo root is
put on `sys.path` first, as `bench/engine.py` does for `runtime`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.broker import Broker, Running, add_broker_args, broker_from_args, mark_tables
from workers.supervisor import free_port

REPO = Path(__file__).resolve().parent.parent
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
MODEL = "smollm2-135m-instruct"

# Prose written for these benches; numbered and repeated into prompts of any length.
TEXT = (
    "The lighthouse keeper kept a ledger of every ship that passed the point: its flag, its "
    "cargo if he could guess it, and the weather that carried it. In winter the entries grew "
    "short and the storms long, and he wrote by lamplight while the beam swept the rocks."
)


# ----------------------------------------------------------------------------- environment


def env_variants() -> list[tuple[str, dict[str, str]]]:
    """The environments our engine runs under: as-is, plus OpenBLAS variables unset if set."""
    as_is = dict(os.environ)
    if not any(name in as_is for name in OPENBLAS_VARS):
        return [("as-is", as_is)]
    unset = {k: v for k, v in as_is.items() if k not in OPENBLAS_VARS}
    return [("as-is", as_is), ("unset", unset)]


def openblas_note() -> str:
    set_vars = {k: os.environ[k] for k in OPENBLAS_VARS if k in os.environ}
    if set_vars:
        return f"OpenBLAS env as-is: {set_vars}; 'unset' = both removed for our processes"
    return f"OpenBLAS env: {' and '.join(OPENBLAS_VARS)} not set here, so as-is = unset"


def openblas_info() -> dict[str, Any]:
    """Which OpenBLAS numpy loaded and which kernel it picked (threadpoolctl's view)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {}
    for pool in threadpool_info():
        if pool.get("internal_api") == "openblas":
            keys = ("architecture", "version", "num_threads", "threading_layer")
            return {k: pool.get(k) for k in keys}
    return {}


def cpu_name() -> str:
    """The CPU's model name (`/proc/cpuinfo`), for a report's first line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "runtime", "workers", "api"],
            cwd=REPO,
            capture_output=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def meta(argv: Sequence[str]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *argv]),
        "cpus": os.cpu_count(),
        "cpu": cpu_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def header(title: str, info: dict[str, Any]) -> list[str]:
    load = " ".join(f"{x:.2f}" for x in info["load_average"])
    cpu = f"{info['cpu']}, " if info.get("cpu") else ""
    return [
        f"{title} | {cpu}{info['cpus']} CPUs | commit {info['commit']} | {info['date']}",
        f"load average at the end: {load} | {openblas_note()}",
    ]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stop_cleanly_on_sigterm() -> None:
    """`kill` of a bench runs its `finally` blocks (a SystemExit), so the systems it started
    (redis-server, gunicorn, workers) are stopped instead of left running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# ----------------------------------------------------------------------------- devices


def add_device_args(p: argparse.ArgumentParser) -> None:
    """`--device` and `--torch-forward`, named as `llmq worker --device` names them."""
    p.add_argument(
        "--device",
        default="cpu",
        help="where our engine runs: cpu or cuda[:N] (as `llmq worker --device`; default cpu). "
        "A CUDA device runs the tensor forward pass with the torch backend; llama.cpp stays "
        "on the CPU as the comparison",
    )
    p.add_argument(
        "--torch-forward",
        action="store_true",
        help="run the tensor forward pass (a GPU's code) on the CPU too; implied by cuda",
    )


def check_device_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Normalise `args.device` and set `args.tensor_path`. A device this machine cannot
    use exits 2 at once with `DeviceError`'s one line, before any child starts."""
    from runtime.devices import DeviceError, check_device, is_cuda

    try:
        args.device = check_device(args.device)
    except DeviceError as exc:
        p.exit(2, f"{p.prog}: {exc}\n")
    args.tensor_path = is_cuda(args.device) or args.torch_forward


def check_tensor_backends(
    p: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]
) -> None:
    """The tensor forward pass has one backend, torch: exit 2 naming any other."""
    others = [b for b in names if b != "torch"]
    if args.tensor_path and others:
        p.error(
            f"the tensor forward pass on {args.device} runs only the torch backend; "
            f"{', '.join(others)} is not valid there"
        )


def engine_config_args(job: dict[str, Any]) -> dict[str, Any]:
    """`EngineConfig` keywords for a child's job: backend, device, and the tensor forward
    pass when asked for (None leaves it to the device: on for CUDA, off for the CPU)."""
    return {
        "backend": job["backend"],
        "device": job.get("device", "cpu"),
        "torch_forward": True if job.get("torch_forward") else None,
    }


def device_figures(device: str) -> dict[str, Any]:
    """The device's description and, on CUDA, the peak memory torch allocated on it in
    this process (the child's whole run: weights, KV pool, activations)."""
    from runtime.devices import describe_device, is_cuda

    peak = None
    if is_cuda(device):
        import torch

        peak = torch.cuda.max_memory_allocated(torch.device(device)) / 2**20
    return {"device": describe_device(device), "peak_device_mib": peak}


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, or None where it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from importlib.metadata import version

    return version("llama-cpp-python")


# ----------------------------------------------------------------------------- children


def run_child(
    script: Path,
    kind: str,
    job: dict[str, Any],
    env: dict[str, str] | None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Run `script --child kind` in a fresh interpreter; the job goes in on stdin and the
    result comes back as the last stdout line (libraries may print before it)."""
    proc = subprocess.run(
        [sys.executable, str(script), "--child", kind],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
        timeout=timeout,
    )
    if proc.returncode != 0:
        hint = ""
        if kind == "llama" and proc.returncode == -signal.SIGSEGV:
            hint = (
                "\nA llama-cpp-python built with GGML_NATIVE=ON enables AMX, which crashes in "
                "some VMs; rebuild with -DGGML_NATIVE=OFF and AMX off "
                "(bench/llama_cmake_args.py; bench/log/2026-11-22-numpy-engine.md)."
            )
        raise RuntimeError(
            f"{kind} child exited with {proc.returncode}:\n{proc.stderr[-3000:]}{hint}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(children: dict[str, Callable[[dict[str, Any]], dict[str, Any]]], kind: str) -> int:
    result = children[kind](json.load(sys.stdin))
    print(json.dumps(result))
    return 0


def peak_rss_mib() -> float:
    """Peak RSS of this process (`VmHWM`: this address space alone; `ru_maxrss` would carry
    the parent's peak across fork and exec)."""
    return _status_mib("VmHWM")


def rss_mib() -> float:
    return _status_mib("VmRSS")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    return 0.0


# ----------------------------------------------------------------------------- prompts


def prose(n_words: int, tag: str = "") -> str:
    """At least `n_words` words of the bench text in numbered sections, starting with `tag`."""
    words, section, parts = 0, 0, [tag] if tag else []
    while words < n_words:
        section += 1
        parts.append(f"{section}. {TEXT}")
        words += len(TEXT.split()) + 1
    return "\n".join(parts)


def prompt_of_tokens(encode: Callable[[str], list[int]], n_tokens: int, tag: str = "") -> str:
    """Bench prose cut to about `n_tokens` tokens (by words, then checked with `encode`)."""
    text = prose(n_tokens, tag)
    words = text.split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # the longest word prefix within n_tokens
        mid = (lo + hi + 1) // 2
        if len(encode(" ".join(words[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


# ----------------------------------------------------------------------------- the system


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    """Block until something accepts connections on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:g}s")


@dataclass
class System:
    """A broker (`broker`, chosen by the script: bench/broker.py) + `llmq api` + N
    `llmq worker`s, each its own process (as `llmq serve` runs them), on free ports; their
    logs go to a temporary directory."""

    models: list[str]
    broker: Broker
    workers: int = 1
    max_sequences: int = 64
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    api_workers: int = 2
    redis_args: list[str] = field(default_factory=list)  # e.g. ["--hz", "100"]
    base_url: str = ""
    redis_url: str = ""
    _redis: Running | None = None
    _procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    _logs: Path | None = None

    def __enter__(self) -> System:
        try:
            self.start()
        except BaseException:  # a system that never got ready must not outlive the bench
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._logs = Path(tempfile.mkdtemp(prefix="llmq-bench-"))
        redis_port, api_port = free_port(), free_port()
        self._redis = self.broker.start(redis_port, tuple(self.redis_args))
        self.redis_url = self._redis.url
        self.base_url = f"http://127.0.0.1:{api_port}"
        env = {**self.env, "REDIS_URL": self.redis_url}
        llmq = [sys.executable, "-m", "llmq"]
        worker = [*llmq, "worker", "--models", ",".join(self.models)]
        worker += ["--max-batch", str(self.max_sequences), "--log-level", "WARNING"]
        for i in range(self.workers):
            self._spawn(f"worker-{i}", worker, env)
        api = [*llmq, "api", "--port", str(api_port), "--workers", str(self.api_workers)]
        self._spawn("api", api, env)
        wait_for_port(api_port, timeout=15)
        self._wait_ready()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        assert self._logs is not None
        out = open(self._logs / f"{name}.log", "wb")
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        self._procs.append((name, proc))

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                ready = httpx.get(f"{self.base_url}/ready", timeout=2).json()
                if ready.get("workers", 0) >= self.workers:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the system was not ready after {timeout}s; logs in {self._logs}")

    def _check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}; its log: {self._logs}/{name}.log"
                )

    def stop(self) -> None:
        """API and workers first (workers unregister through Redis), then the broker."""
        for _, proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)

    def redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis_url)

    def worker_pids(self) -> list[int]:
        return [proc.pid for name, proc in self._procs if name.startswith("worker")]


# ----------------------------------------------------------------------------- client


@dataclass
class Stream:
    """One streamed response: when it was sent, and when each content chunk arrived."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time from the first chunk to the last. A token
        whose text is empty (part of a UTF-8 character) sends no chunk, so the count comes
        from `usage` when the stream reported it."""
        tokens = self.completion_tokens or len(self.chunks)
        return (tokens - 1) / (self.chunks[-1] - self.chunks[0])


def stream(client: Any, path: str, body: dict[str, Any]) -> Stream:
    """POST a streaming request; timestamps every chunk that carries generated text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chat = path.endswith("/chat/completions")
    out = Stream(time.perf_counter())
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            out.error = f"{response.status_code}: {response.text[:300]}"
            return out
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            if "error" in chunk:
                out.error = str(chunk["error"])
            for choice in chunk.get("choices") or []:
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if text:
                    out.chunks.append(time.perf_counter())
    return out


THINK_SECONDS = (0.15, 0.35)
_think = random.Random(0)


def think() -> None:
    """A pause of random length before a request, so requests reach an idle worker at any
    moment of its polling loop, as independent users' would, not in step with it."""
    time.sleep(_think.uniform(*THINK_SECONDS))


def http_client(base_url: str, connections: int = 8) -> Any:
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.Client(base_url=base_url, timeout=600, limits=limits)


def concurrent_streams(base_url: str, path: str, bodies: Sequence[dict[str, Any]]) -> list[Stream]:
    """One thread per request, released together; returns when every stream has ended."""
    results: list[Stream | None] = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))
    with http_client(base_url, len(bodies)) as client:

        def run(i: int) -> None:
            barrier.wait()
            try:
                results[i] = stream(client, path, bodies[i])
            except Exception as exc:  # reported with the figures, never hidden
                results[i] = Stream(time.perf_counter(), error=f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    out = [r for r in results if r is not None]
    errors = [r.error for r in out if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(out)} streams failed, e.g. {errors[0]}")
    return out


def steady_rate(streams: Sequence[Stream]) -> tuple[float, float, int]:
    """Aggregate decode rate while every stream is decoding: chunks that arrive after the
    last stream's first token and up to the first stream's last token, over that window.
    A stream whose tokens did not all send a chunk (empty text) has its count scaled by
    tokens / chunks. Returns (tokens/s, window seconds, tokens in it)."""
    start = max(s.chunks[0] for s in streams)
    end = min(s.chunks[-1] for s in streams)
    if end <= start:
        return float("nan"), 0.0, 0
    n = 0.0
    for s in streams:
        per_chunk = (s.completion_tokens or len(s.chunks)) / len(s.chunks)
        n += per_chunk * sum(1 for t in s.chunks if start < t <= end)
    return n / (end - start), end - start, round(n)


# ----------------------------------------------------------------------------- statistics


def best(values: Sequence[float], higher_is_better: bool = True) -> float:
    return max(values) if higher_is_better else min(values)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ----------------------------------------------------------------------------- scripts

Children = dict[str, Callable[[dict[str, Any]], dict[str, Any]]]
Part = Callable[[argparse.Namespace, str, dict[str, str]], Any]


def bench_parser(doc: str | None, quick: str = "") -> argparse.ArgumentParser:
    """A bench script's parser: its module docstring, as written, is its `--help`; with
    `quick`, a `--quick` option that does what it says."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def add_system_args(p: argparse.ArgumentParser, children: Children) -> None:
    """The last options of a script that starts a system (bench/system.py,
    bench/throughput.py): its broker (bench/broker.py), `--json FILE` for the raw figures,
    and the hidden `--child KIND` that `run_child` starts the script with."""
    add_broker_args(p)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--child", choices=sorted(children), help=argparse.SUPPRESS)


def choose_broker(p: argparse.ArgumentParser, args: argparse.Namespace, needed: bool) -> None:
    """`args.broker`: the broker the options name, chosen once; None where no system starts
    (`needed` false) or in a `--child`."""
    args.broker = broker_from_args(p, args) if needed and not args.child else None


def measure_per_env(
    args: argparse.Namespace, parts: dict[str, Part], wanted: set[str]
) -> dict[str, dict[str, Any]]:
    """`{env: {part: run(args, env name, env)}}` for the parts `wanted`, in `parts`' order,
    under each of `env_variants()`."""
    out: dict[str, dict[str, Any]] = {}
    for name, env in env_variants():
        per_env: dict[str, Any] = {}
        for part, run in parts.items():
            if part in wanted:
                started = time.perf_counter()
                per_env[part] = run(args, name, env)
                log(f"  {part} ({name}) took {time.perf_counter() - started:.0f} s")
        out[name] = per_env
    return out


def script_main(
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    children: Children,
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> Callable[[Sequence[str] | None], int]:
    """A bench script's `main(argv)`: parse, then `run_script`."""

    def main(argv: Sequence[str] | None = None) -> int:
        return run_script(parse_args(argv), children, measure, render)

    return main


def run_script(
    args: argparse.Namespace,
    children: Children,
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """A bench script's main once its options are parsed: as a `--child`, that child's job;
    else print `render(measure(args))` and write the raw figures to `--json`. `raw["meta"]`
    gets the run's metadata, its broker's name and its wall time; on a fake broker every
    table printed says so (bench/broker.py `mark_tables`). A SIGTERM stops the systems it
    started (`stop_cleanly_on_sigterm`)."""
    stop_cleanly_on_sigterm()
    if args.child:
        return child_main(children, args.child)
    started = time.perf_counter()
    raw = measure(args)
    broker = args.broker
    raw["meta"] = {
        **meta(sys.argv),
        **raw.get("meta", {}),
        "broker": broker.describe() if broker else None,
        "fake_broker": bool(broker and broker.fake),
        "wall_s": time.perf_counter() - started,
    }
    text = render(raw)
    print(mark_tables(text) if raw["meta"]["fake_broker"] else text)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
    return 0
