"""What the token-path benches (bench/fleet.py, bench/redis_cost.py) share: a job without an
engine, the result its last write carries, and what Redis says it spent on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from workers.jobs import ActiveJob
from workers.wire.job import COMPLETIONS, response_id


@dataclass(eq=False)
class SimJob(ActiveJob):
    """An `ActiveJob` without an engine: its tokens are counted here."""

    tokens: int = 0
    max_tokens: int = 16

    @property
    def completion_tokens(self) -> int:
        return self.tokens


def result_body(job: SimJob, text: str) -> dict[str, Any]:
    """The completion a worker stores as the job's result: `text`, ended by its length."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    usage = {"prompt_tokens": 1, "completion_tokens": job.tokens, "total_tokens": job.tokens + 1}
    return {
        "id": response_id(COMPLETIONS, job.id),
        "object": "text_completion",
        "created": int(job.record.created_at),
        "model": job.record.responds_as,
        "choices": [choice],
        "usage": usage,
    }


def redis_cpu(conn: redis.Redis) -> float:
    """Seconds of CPU the server has used (`used_cpu_sys` + `used_cpu_user`)."""
    cpu = conn.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def command_stats(conn: redis.Redis) -> dict[str, dict[str, Any]]:
    """INFO commandstats by command name (`evalsha`, not `cmdstat_evalsha`)."""
    return {
        name.removeprefix("cmdstat_"): stats for name, stats in conn.info("commandstats").items()
    }


def add_cluster_stats(stats: dict[str, dict[str, Any]], node: redis.Redis) -> None:
    """Adds a cluster node's commandstats to `stats` as `cluster:<command>`, summed over
    the nodes."""
    for name, s in command_stats(node).items():
        mine = stats.setdefault(f"cluster:{name}", {"calls": 0, "usec": 0.0})
        mine["calls"] = int(mine["calls"]) + int(s["calls"])
        mine["usec"] = float(mine["usec"]) + float(s["usec"])
        mine["usec_per_call"] = float(mine["usec"]) / max(1, int(mine["calls"]))
