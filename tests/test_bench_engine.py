"""The engine bench judges the kernel layer's targets on the torch backend (bench/engine.py), from
made-up runs, and bench/device_profile.py counts host syncs from made-up profiler events:
no model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import engine as bench
from bench import harness
from bench.device_profile import ProfiledOp, count_syncs

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


def test_without_llama_cpp_the_table_has_our_columns_alone() -> None:
    raw = _raw(["torch"])
    raw["runs"] = [r for r in raw["runs"] if r["engine"] != "llama"]
    raw["meta"]["llama_cpp_version"] = None
    m = bench.summarize(raw)["envs"]["as-is"]["models"][MODEL]
    assert m["llama"] is None and "targets" not in m
    table = bench.render(raw, bench.summarize(raw))
    assert "llama.cpp not run" in table and "torch/llama" not in table


def test_a_gpu_child_shows_its_peak_device_memory() -> None:
    raw = _raw(["torch"])
    for run in raw["runs"]:
        if run["engine"] == "torch":
            run |= {"device": "cuda:0 (Fake GPU, 80.0 GiB)", "peak_device_mib": 1234.0}
    table = bench.render(raw, bench.summarize(raw))
    assert "on cuda:0 (Fake GPU, 80.0 GiB)" in table
    assert "peak device memory (MiB)" in table and "1234" in table
    assert "llama.cpp (CPU)" in table


def test_the_tensor_path_refuses_numpy_and_a_malformed_device() -> None:
    for argv in (["--torch-forward", "--backends", "numpy,torch"], ["--device", "gpu"]):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args([*argv, "--no-llama"])
        assert exit_.value.code == 2
    args = bench.parse_args(["--torch-forward", "--no-llama"])
    assert args.backends == ["torch"] and args.tensor_path and args.device == "cpu"
    job = {"backend": "torch", "device": args.device, "torch_forward": args.tensor_path}
    assert harness.engine_config_args(job) == job  # EngineConfig's keywords
    assert harness.engine_config_args({"backend": "numpy"})["torch_forward"] is None


def test_host_syncs_are_counted_once_per_copy_and_scalar_read() -> None:
    dtoh = "Memcpy DtoH (Device -> Pageable)"
    ops = [
        ProfiledOp("aten::to"),  # to -> _to_copy -> copy_: one copy, launched by copy_
        ProfiledOp("aten::_to_copy"),
        ProfiledOp("aten::copy_", launched=(dtoh,)),
        ProfiledOp(dtoh, on_device=True),
        ProfiledOp("aten::copy_", launched=("Memcpy HtoD (Pageable -> Device)",)),
        ProfiledOp("aten::item"),  # item -> _local_scalar_dense: one read
        ProfiledOp("aten::_local_scalar_dense", launched=(dtoh,)),
        ProfiledOp(dtoh, on_device=True),
        ProfiledOp("aten::nonzero"),
        *[ProfiledOp("aten::scaled_dot_product_attention")] * 30,
        *[ProfiledOp("ampere_bf16_gemm", on_device=True)] * 5,
        ProfiledOp("Memset (Device)", on_device=True),
    ]
    counts = count_syncs(ops)
    assert (counts.dtoh_copies, counts.to_host_copies, counts.scalar_reads) == (2, 1, 1)
    assert counts.items == 1 and counts.data_sized == 1 and counts.host_syncs == 3
    assert counts.sdpa_calls == 30 and counts.kernels == 5
    assert counts.per_step(2)["host_syncs"] == 1.5


@pytest.mark.slow
def test_device_profile_runs_end_to_end_on_the_cpu(capsys) -> None:
    """The profiler bench on the real SmolLM2 (CPU tensor path): its table, and no host sync
    in a decode step (what a GPU run must show too)."""
    from bench import device_profile

    assert device_profile.main(["--device", "cpu", "--sequences", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor forward pass: True; 4 sequences" in out
    assert "host syncs per step 0.0 <= 4" in out and "PASS" in out
    assert "per layer (decode groups)                               1.0" in out


def test_a_short_context_model_gets_prompts_that_fit_it() -> None:
    """The architecture fixtures hold 256 positions: half to prefill, the rest less the
    decoded tokens as the decode's context (bench/engine.py's 512 and 540 do not fit)."""
    fixture = Path(__file__).parent / "fixtures" / "arch" / "qwen3-F16.gguf"
    ids = bench.prompt_ids(fixture, decode_tokens=64)
    assert len(ids["prefill_ids"]) == 128 and len(ids["decode_ids"]) == 256 - 64 - 2
    assert ids["decode_ids"][:128] == ids["prefill_ids"]  # prefixes of one text
