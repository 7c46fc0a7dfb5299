"""`llmq generate` and `llmq models`: the engine in-process, no Redis.

`add_runtime_commands` adds them to the `llmq` parser (llmq/cli.py builds the whole CLI).

Only generated text goes to stdout (streamed as it is produced), so the output can be piped;
`--stats` adds one JSON line on stderr. Errors a user can cause print one line, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from runtime.cli_options import add_command
from runtime.errors import LLMQRuntimeError
from runtime.kernels import BACKENDS
from runtime.registry import DEFAULT_MODEL, load_registry

GENERATE_HELP = """run a model in-process and stream its completion to stdout

Run a model in this process (no Redis) and stream only the generated text to stdout.
"""


def add_runtime_commands(sub: argparse._SubParsersAction) -> None:
    gen = add_command(sub, "generate", GENERATE_HELP)
    gen.add_argument("prompt", nargs="?", help="prompt text; '-' or omitted reads stdin")
    gen.add_argument("-m", "--model", default=DEFAULT_MODEL, help="model id or .gguf path")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature, as OpenAI's API; 0 is greedy and deterministic",
    )
    gen.add_argument(
        "--top-p", type=float, default=1.0, help="keep the most likely tokens up to this mass"
    )
    gen.add_argument("--top-k", type=int, default=0, help="keep the K most likely; 0 disables")
    gen.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this share of the top one's"
    )
    gen.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="1 disables (llama.cpp's)"
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--seed", type=int, help="makes sampling reproducible")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--backend",
        choices=BACKENDS,
        help="kernel backend: numpy (exact float32) or torch (quantized weights, compiled "
        "kernels); default: the registry entry's, else torch where installed",
    )
    gen.add_argument(
        "--device",
        help="cpu or cuda[:N]: where the forward pass runs; default: the registry entry's, "
        "else cpu",
    )
    gen.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a GGUF LoRA adapter (llama.cpp's layout) applied at SCALE (default 1); "
        "repeatable: adapters stack",
    )
    gen.add_argument(
        "--stats",
        action="store_true",
        help="print one JSON line on stderr at the end: prompt_tokens, completion_tokens, "
        "prefill_tok_s, decode_tok_s, ttft_ms, load_s",
    )
    gen.set_defaults(handler=run_generate)

    models = sub.add_parser(
        "models",
        help="list the models the registry knows",
        description="list the models the registry knows: where their files are, their "
        "architecture, backend and resident bytes, and under each the quant types it holds "
        "and how each is kept (a type no kernel multiplies from its codes is named)",
    )
    models.add_argument(
        "--supported",
        action="store_true",
        help="list the supported architectures and every quant type with how it is multiplied",
    )
    models.set_defaults(handler=run_models)


def run_generate(args: argparse.Namespace) -> int:
    from runtime.engine import Engine, EngineConfig
    from runtime.sampling import SamplingParams

    prompt = args.prompt if args.prompt not in (None, "-") else sys.stdin.read()
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )
    engine = Engine.load(args.model, EngineConfig(backend=args.backend, device=args.device))
    lora = []
    for i, item in enumerate(args.lora):
        path, scale = _lora_argument(item)
        engine.load_adapter(f"cli-{i}", path)
        lora.append((f"cli-{i}", scale))
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt_ids = engine.encode_chat(messages + [{"role": "user", "content": prompt}])
    else:
        prompt_ids = engine.encode(prompt)
    started = time.perf_counter()
    first = last = started
    completion_tokens = 0
    for event in engine.generate(prompt_ids, params, lora):
        last = time.perf_counter()
        if completion_tokens == 0:
            first = last
        completion_tokens += 1
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        ttft = first - started
        stats = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "prefill_tok_s": round(len(prompt_ids) / ttft, 2) if ttft > 0 else None,
            "decode_tok_s": round((completion_tokens - 1) / (last - first), 2)
            if completion_tokens > 1 and last > first
            else None,
            "ttft_ms": round(ttft * 1000, 2),
            "load_s": round(engine.load_seconds, 3),
        }
        print(json.dumps(stats), file=sys.stderr)
    return 0


def _lora_argument(item: str) -> tuple[str, float]:
    """`PATH[:SCALE]` as (path, scale)."""
    path, _, scale = item.rpartition(":")
    try:
        return (path, float(scale)) if path else (item, 1.0)
    except ValueError:
        return item, 1.0


def run_models(args: argparse.Namespace) -> int:
    from runtime.chat_formats import ChatFormat
    from runtime.gguf_file import GGUFFile
    from runtime.kernels import get_backend
    from runtime.kernels.quant_types import describe_types, supported_lines, unmultiplied
    from runtime.models import ARCHITECTURES, estimate_weight_bytes

    if args.supported:
        print("architectures:", ", ".join(sorted(ARCHITECTURES)))
        print("quant types (the torch backend on the CPU):")
        print("\n".join(supported_lines()))
        return 0
    types: dict[str, str] = {}

    rows = [("ID", "ARCH", "FILE", "BACKEND", "RESIDENT", "PATH")]
    for spec in load_registry().values():
        try:
            path = spec.path()
            f = GGUFFile(path)
            backend = get_backend(spec.backend)
            resident = estimate_weight_bytes(f, backend)
            types[spec.id] = f"    types: {describe_types(f, backend)}"
            template = spec.chat_template or f.metadata.get("tokenizer.chat_template")
            if template:  # the format its tool calls and thinking are parsed in
                types[spec.id] += f"\n    chat format: {ChatFormat.of(template).name}"
            if getattr(ARCHITECTURES.get(f.architecture), "recurrent", False):
                types[spec.id] += (
                    "\n    prefix cache: off (recurrent state per sequence), host path only"
                )
            if backend.name != "numpy" and unmultiplied(f, backend):
                names = ", ".join(t.name for t in unmultiplied(f, backend))
                types[spec.id] += f"\n    not multiplied from their codes yet: {names}"
            size = f"{path.stat().st_size / 2**20:.0f} MiB"
            rows.append(
                (
                    spec.id,
                    f.architecture,
                    size,
                    backend.name,
                    f"{resident / 2**20:.0f} MiB",
                    str(path),
                )
            )
        except LLMQRuntimeError as exc:
            rows.append((spec.id, "-", "-", "-", "-", f"unavailable: {exc}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)), row[5])
        if row[0] in types:
            print(types[row[0]])
    return 0
