"""The engine bench judges issue 9's targets on the torch backend (bench/engine.py), from
made-up runs: no model is loaded."""

from __future__ import annotations

from typing import Any

from bench import engine as bench

MODEL = "smollm2-135m-instruct"


def _run(engine: str, ttft_s: float, decode_s: float, load_s: float, rss: float) -> dict:
    run: dict[str, Any] = {"kind": "llama" if engine == "llama" else "ours", "engine": engine}
    run |= {"env": "as-is", "model": MODEL, "tokens": [1] * 17, "ttft_s": ttft_s}
    run |= {"decode_s": decode_s, "load_s": load_s, "peak_rss_mib": rss}
    if engine != "llama":
        run |= {"kernels": {"all weights": engine}, "weight_kinds": {"int4": 120, "int8": 1}}
        run |= {"weight_bytes": 100_000_000, "import_s": 1.5}
    return run


def _raw(backends: list[str]) -> dict[str, Any]:
    bandwidth = {"kind": "bandwidth", "engine": "bandwidth", "env": "as-is", "model": None}
    bandwidth |= {"matvec_gbps": 20.0, "sum_gbps": 10.0, "openblas": {}}
    runs = [bandwidth, _run("llama", 1.0, 1.0, 0.1, 200.0)]
    runs += [_run("numpy", 0.5, 2.0, 2.0, 800.0), _run("torch", 0.25, 0.8, 0.4, 390.0)]
    meta = {"llama_cpp_version": "0", "cpus": 2, "repeat": 1, "commit": "c", "date": "d"}
    meta |= {"wall_s": 1.0, "loadavg_1m_start_end": [0.0, 0.0], "numpy": "2", "torch": "2"}
    meta |= {"decode_tokens": 16, "decode_context": 540, "bandwidth_mib": 512}
    return {
        "variants": ["as-is"],
        "backends": backends,
        "models": {MODEL: {"path": "/m/model.gguf", "file_bytes": 98_000_000}},
        "runs": [r for r in runs if r["engine"] in (*backends, "llama", "bandwidth")],
        "meta": meta,
    }


def test_targets_are_judged_on_the_torch_backend() -> None:
    raw = _raw(["numpy", "torch"])
    targets = bench.summarize(raw)["envs"]["as-is"]["models"][MODEL]["targets"]
    assert targets["prefill_tps"]["met"]  # 4x llama.cpp >= 3x
    assert targets["decode_tps"]["met"] and not targets["decode_tps"]["moonshot_met"]  # 1.25x
    assert targets["load_s"]["met"] and targets["peak_rss_mib"]["met"]  # 0.4 s, 1.95x
    table = bench.render(raw, bench.summarize(raw))
    assert "numpy/llama" in table and "torch/llama" in table
    assert "<= 0.5 s: PASS (0.40 s)" in table
    assert "moonshot 1.5x: MISS" in table


def test_without_the_torch_backend_nothing_is_judged() -> None:
    raw = _raw(["numpy"])
    m = bench.summarize(raw)["envs"]["as-is"]["models"][MODEL]
    assert "targets" not in m and m["numpy_decode_limit_tps"] > 0
    assert "targets not judged" in bench.render(raw, bench.summarize(raw))
