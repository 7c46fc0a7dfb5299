"""`llmq generate` and `llmq models` as a user runs them: a real process, real output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LLMQ = Path(sys.executable).with_name("llmq")


def llmq(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LLMQ), *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def greedy(*args: str, max_tokens: int, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`llmq generate --temperature 0 --max-tokens N ARGS`: the same text on every run."""
    options = ("--temperature", "0", "--max-tokens", str(max_tokens))
    return llmq("generate", *options, *args, stdin=stdin)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmq: error:"), result.stderr
    assert fragment in lines[0]


def test_console_script_is_installed():
    assert LLMQ.is_file(), "pip install -e . should install the llmq console script"


def test_generate_streams_text_and_stats(tiny_llama_path):
    result = greedy("-m", str(tiny_llama_path), "--stats", "the cat", max_tokens=6)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert set(stats) == {
        "prompt_tokens",
        "completion_tokens",
        "prefill_tok_s",
        "decode_tok_s",
        "ttft_ms",
        "load_s",
    }
    assert stats["completion_tokens"] == 6 and stats["prompt_tokens"] > 0
    assert result.stdout.endswith("\n")


def test_generate_reads_the_prompt_from_stdin(tiny_llama_path):
    from_arg = greedy("-m", str(tiny_llama_path), "the cat", max_tokens=4)
    from_stdin = greedy("-m", str(tiny_llama_path), max_tokens=4, stdin="the cat")
    assert from_stdin.returncode == 0 and from_stdin.stdout == from_arg.stdout


@pytest.mark.slow
def test_generate_with_smollm2_answers_sensibly():
    result = greedy("-m", "smollm2-135m-instruct", "The capital of France is", max_tokens=8)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_generate_chat_with_smollm2_answers_a_question():
    result = greedy("--chat", "What is the capital of Japan?", max_tokens=30)
    assert result.returncode == 0, result.stderr
    assert "Tokyo" in result.stdout


def test_generate_with_lora_adapters(tiny_llama_path, tmp_path):
    from tests.tiny_models import write_lora

    adapter = write_lora(tmp_path / "a.gguf", tiny_llama_path, seed=7)
    args = ("generate", "-m", str(tiny_llama_path), "--temperature", "0", "--max-tokens", "6")
    plain = llmq(*args, "the cat")
    adapted = llmq(*args, "--lora", f"{adapter}:2.5", "the cat")
    off = llmq(*args, "--lora", f"{adapter}:0", "the cat")
    assert adapted.returncode == 0, adapted.stderr
    assert adapted.stdout != plain.stdout and off.stdout == plain.stdout
    wrong = write_lora(tmp_path / "g.gguf", tiny_llama_path, architecture="gemma3")
    assert_one_line_error(llmq(*args, "--lora", str(wrong), "hi"), "architecture 'gemma3'")


def test_unknown_model_is_one_line(tmp_path):
    assert_one_line_error(llmq("generate", "-m", "no-such-model", "hi"), "unknown model")


def test_empty_prompt_is_one_line(tiny_llama_path):
    assert_one_line_error(llmq("generate", "-m", str(tiny_llama_path), ""), "prompt is empty")


def test_bad_sampling_value_is_one_line(tiny_llama_path):
    result = llmq("generate", "-m", str(tiny_llama_path), "--top-p", "1.5", "hi")
    assert_one_line_error(result, "top_p")


def test_corrupt_and_truncated_files_are_one_line(tmp_path, tiny_llama_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 64)
    assert_one_line_error(llmq("generate", "-m", str(corrupt), "hi"), "corrupt.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama_path.read_bytes()[:5000])
    assert_one_line_error(llmq("generate", "-m", str(truncated), "hi"), "truncated.gguf")
    missing = tmp_path / "missing.gguf"
    assert_one_line_error(llmq("generate", "-m", str(missing), "hi"), "missing.gguf")


def test_models_lists_the_built_in_models():
    result = llmq("models")
    assert result.returncode == 0, result.stderr
    assert "smollm2-135m-instruct" in result.stdout and "gemma-3-270m" in result.stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout


def test_models_reads_a_toml_registry(tmp_path, tiny_llama_path):
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny]\npath = "{tiny_llama_path}"\n')
    result = subprocess.run(
        [str(LLMQ), "models"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LLMQ_MODELS": str(registry)},
    )
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("tiny ") and "llama" in line for line in result.stdout.splitlines())


@pytest.mark.parametrize("args", [("--help",), ("generate", "--help"), ("models", "--help")])
def test_help_is_complete(args):
    result = llmq(*args)
    assert result.returncode == 0 and "usage: llmq" in result.stdout


def test_models_shows_each_entrys_backend_and_resident_bytes(tmp_path, tiny_llama_path):
    registry = tmp_path / "models.toml"
    registry.write_text(
        f'[models.tiny]\npath = "{tiny_llama_path}"\nbackend = "numpy"\n'
        f'[models.tiny-fast]\npath = "{tiny_llama_path}"\nbackend = "torch"\n'
    )
    env = {**os.environ, "LLMQ_MODELS": str(registry)}
    result = subprocess.run(
        [str(LLMQ), "models"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert rows["tiny"][4] == "numpy" and rows["tiny-fast"][4] == "torch"  # after "N MiB"
    assert "BACKEND" in result.stdout and "RESIDENT" in result.stdout


def test_a_registry_backend_outside_the_known_ones_is_a_clear_error(tmp_path, tiny_llama_path):
    from runtime.errors import ModelNotFoundError
    from runtime.registry import load_registry

    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny]\npath = "{tiny_llama_path}"\nbackend = "jax"\n')
    with pytest.raises(ModelNotFoundError, match="backend must be one of numpy, torch"):
        load_registry(registry)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_generate_answers_paris_on_both_backends(backend):
    result = llmq(
        "generate",
        "--backend",
        backend,
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--stats",
        "The capital of France is",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert json.loads(result.stderr.strip().splitlines()[-1])["completion_tokens"] == 4


def test_generate_on_a_gpu_without_cuda_is_a_one_line_error(tiny_llama_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = llmq("generate", "-m", str(tiny_llama_path), "--device", "cuda", "hi")
    assert_one_line_error(result, "sees no CUDA device")


def test_generate_runs_on_the_cpu_device(tiny_llama_path):
    result = llmq(
        "generate", "-m", str(tiny_llama_path), "--device", "cpu", "--max-tokens", "3", "hi"
    )
    assert result.returncode == 0, result.stderr
