"""Cold load and resident weight bytes: llmq's load of a GGUF file against llama.cpp's.

`make` builds a file of a real model's shape with random weights the way real files are
made (tests/fixtures/make_arch_models.py's recipe at the real sizes: a transformers config,
seeded random weights, llama.cpp's convert_hf_to_gguf.py, `llama_model_quantize`):
Llama-3.2-1B's (the default), Qwen3-1.7B's, or four layers of Qwen3-30B-A3B's (`--shape`);
bench/engine.py times them against llama.cpp.
`measure` loads each file in a fresh process: cold (an empty LLMQ_CACHE_DIR), then warm (the
prepared weights saved by the cold load mapped), and llama.cpp's load of the same file;
CPU time by `time.process_time` (the machine is shared: wall time is printed with the load
average beside it), the weights' bytes as the model keeps them (`model.nbytes`, the
embedding counted at its file bytes: it stays in the mapped file) against the file's
tensor bytes, and the process's RSS growth; and the CPU time of the prepared weights' save
where it runs in a thread after the load (runtime/kernels/prepared.py). `--profile`
prints cProfile's top functions of a cold load.

    LLAMA_CPP_SRC=/tmp/cl-llama/llama_cpp_python-0.3.36/vendor/llama.cpp \
        nice .venv/bin/python bench/cold_load.py make --out /tmp/l1b [--shape qwen3-1.7b]
    .venv/bin/python bench/cold_load.py measure /tmp/l1b/llama-1b-Q4_K_M.gguf \
        tests/fixtures/arch/llama-q-Q4_K_M.gguf --llama-cpp
    .venv/bin/python bench/cold_load.py measure /tmp/l1b/llama-1b-Q4_K_M.gguf --profile
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests/fixtures/make_arch_models.py"
TINY = REPO / "tests/fixtures/arch/llama-q-Q4_K_M.gguf"
# convert_hf_to_gguf.py and its packages: the sdist's vendored llama.cpp, untarred outside
# the repository (`tar xzf build/llama-cpp-python-src/llama_cpp_python-0.3.36.tar.gz -C ...`)
LLAMA_CPP_ENV = "LLAMA_CPP_SRC"
# Llama 3.2 1B's sizes (its config.json), random weights
LLAMA_32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)

# Qwen3-1.7B's sizes (its config.json), random weights
QWEN3_17B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
# Qwen3-30B-A3B's layer (128 experts, 8 used, normalized top-k) with 4 of its 48 layers: its
# per-layer work and expert routing at a size this machine's 24 GiB converts (about 2.5 B
# weights; the whole model's F16 is 61 GB)
QWEN3_30B_A3B_4_LAYERS = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
# `make --shape`: the file name's stem -> (transformers config class, its sizes, architecture)
SHAPES = {
    "llama-1b": ("LlamaConfig", LLAMA_32_1B, "llama"),
    "qwen3-1.7b": ("Qwen3Config", QWEN3_17B, "qwen3"),
    "qwen3moe-30b-a3b-4l": ("Qwen3MoeConfig", QWEN3_30B_A3B_4_LAYERS, "qwen3moe"),
}


def _fixtures():
    """tests/fixtures/make_arch_models.py as a module (its tokenizer, weights, converter)."""
    spec = importlib.util.spec_from_file_location("make_arch_models", FIXTURES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(out: Path, types: list[str], shape: str = "llama-1b") -> None:
    """One real shape's Hugging Face folder (SHAPES), its F16 GGUF and each quantized type
    under `out`, named `{shape}-{type}.gguf`."""
    import torch

    fx = _fixtures()
    if os.environ.get(LLAMA_CPP_ENV):
        fx.LLAMA_CPP = Path(os.environ[LLAMA_CPP_ENV])
    out.mkdir(parents=True, exist_ok=True)
    folder, f16 = out / f"hf-{shape}", out / f"{shape}-F16.gguf"
    if not f16.exists():
        # 369 tokens in the tokenizer; the converter pads the rest as [PAD] tokens
        fx.build_hf(shape, SHAPES[shape], folder, torch.float16)
        fx.convert(folder, f16)
        shutil.rmtree(folder)  # gigabytes, and the F16 file holds the same weights
    for qtype in types:
        target = out / f"{shape}-{qtype}.gguf"
        if not target.exists():
            fx.quantize(f16, target, qtype)
        print(f"{target} {target.stat().st_size / 2**20:.0f} MiB")


def tensor_bytes(path: Path) -> int:
    """The bytes the file's tensors take (its size less header and padding)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child_llmq(path: str, profile: bool) -> dict:
    """One load in this process: CPU and wall seconds, the weights' bytes, RSS growth."""
    from runtime.gguf_file import GGUFFile
    from runtime.kernels import get_backend
    from runtime.models import load_model

    backend = get_backend("torch")  # its libraries imported: not part of the load
    rss = rss_mib()
    cpu, wall = time.process_time(), time.perf_counter()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
        model = prof.runcall(load_model, GGUFFile(path), backend)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    else:
        model = load_model(GGUFFile(path), backend)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    rss_loaded = rss_mib()
    save_cpu = time.process_time()  # a large store is written by a thread after the load
    for thread in threading.enumerate():
        if thread.name == "llmq-prepared-save":
            thread.join()
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "save_cpu_s": time.process_time() - save_cpu,
        "weight_bytes": int(model.nbytes),
        "rss_growth_mib": rss_loaded - rss,
        "kinds": model.weight_kinds(),
    }


def child_llama_cpp(path: str) -> dict:
    import llama_cpp

    rss = rss_mib()
    cpu, wall = time.process_time(), time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    del llm
    return {"cpu_s": cpu, "wall_s": wall, "rss_growth_mib": rss_mib() - rss}


def run_child(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "child", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    if "--profile" in args:
        print(done.stderr)
    elif done.stderr.strip():  # warnings (a store that could not be read or written)
        print(done.stderr.strip()[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(paths: list[Path], llama_cpp: bool, profile: bool, repeat: int) -> None:
    """Each file cold (no prepared weights: LLMQ_CACHE_DIR's weights/ emptied, its compiled
    kernels kept, as on a machine that served any model before) and warm, `repeat` times."""
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as cache:
        env = {"LLMQ_CACHE_DIR": cache}
        run_child(["llmq", str(TINY)], env)  # compiles the C kernels into the cache
        for path in paths:
            file_bytes = tensor_bytes(path)
            print(f"{path.name}: tensors {file_bytes / 2**20:.1f} MiB")
            for _ in range(repeat):
                for folder in ("weights", "digests"):  # the file neither hashed nor built
                    shutil.rmtree(Path(cache) / folder, ignore_errors=True)
                for label in ("cold", "warm"):
                    flags = ["--profile"] if profile and label == "cold" else []
                    r = run_child(["llmq", str(path), *flags], env)
                    ratio = r["weight_bytes"] / file_bytes
                    print(
                        f"  llmq {label}: cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s, "
                        f"then the save's cpu {r['save_cpu_s']:.2f} s, "
                        f"weights {r['weight_bytes'] / 2**20:.1f} MiB ({ratio:.3f}x file), "
                        f"rss +{r['rss_growth_mib']:.0f} MiB, "
                        f"load avg {os.getloadavg()[0]:.1f}; {r['kinds']}"
                    )
                if llama_cpp:
                    r = run_child(["llama.cpp", str(path)], {})
                    print(
                        f"  llama.cpp: cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s, "
                        f"rss +{r['rss_growth_mib']:.0f} MiB, load avg {os.getloadavg()[0]:.1f}"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_make = sub.add_parser("make")
    p_make.add_argument("--out", type=Path, default=Path("/tmp/l1b"))
    p_make.add_argument("--types", default="Q4_K_M")
    p_make.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p_measure = sub.add_parser("measure")
    p_measure.add_argument("paths", type=Path, nargs="+")
    p_measure.add_argument("--llama-cpp", action="store_true")
    p_measure.add_argument("--profile", action="store_true")
    p_measure.add_argument("--repeat", type=int, default=1)
    p_child = sub.add_parser("child")
    p_child.add_argument("engine", choices=("llmq", "llama.cpp"))
    p_child.add_argument("path")
    p_child.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.command == "make":
        make(args.out, args.types.split(","), args.shape)
    elif args.command == "measure":
        measure(args.paths, args.llama_cpp, args.profile, args.repeat)
    elif args.engine == "llmq":
        sys.path.insert(0, str(REPO))
        print(json.dumps(child_llmq(args.path, args.profile)))
    else:
        print(json.dumps(child_llama_cpp(args.path)))


if __name__ == "__main__":
    main()
