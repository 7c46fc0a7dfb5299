"""A loaded model with everything needed to serve it: tokenizer, chat template, sampler.

`Engine.load("smollm2-135m-instruct")` resolves the id through the registry, reads the
GGUF, and builds the architecture's model. Generation goes through `Generator` even
for one sequence, so `llmq generate`, the worker and the benches share one code path.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.chat_template import ChatTemplate
from runtime.devices import CPU
from runtime.errors import AdapterError, AdapterNotFoundError, EmptyPromptError
from runtime.generator import Generator, GeneratorConfig, TokenEvent
from runtime.gguf_file import GGUFFile
from runtime.grammar_vocab import GrammarVocab
from runtime.kernels.cpu import KernelPlan
from runtime.kv_pool import BLOCK_SIZE
from runtime.lora import (
    DEFAULT_LORA_RANK,
    DEFAULT_LORA_SLOTS,
    AdapterStack,
    LoraAdapter,
    adapter_file,
    load_adapter,
    normalize_stack,
)
from runtime.model_text import ModelText
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.placement import (
    check_minimal_pool,
    device_memory_guard,
    kv_budget_bytes,
    load_placed,
    place,
)
from runtime.prefix_cache import PrefixCache
from runtime.registry import ModelSpec, resolve
from runtime.sampling import Sampler, SamplingParams
from runtime.step_runners import HostRows, HostSteps

if TYPE_CHECKING:
    from runtime.decode_graphs import DecodeGraphs
    from runtime.device_steps import DeviceSteps
    from runtime.lora_slots import LoraSlots

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Limits of one engine; None takes the model's own."""

    max_context: int | None = None
    prefill_chunk: int = 512  # prompt tokens per forward pass (bounds attention memory)
    # paged KV pool; None: 1024 on the CPU (pages are only backed once blocks are used),
    # on a GPU half the memory free after the weights, at most CUDA_KV_MAX_MB
    kv_memory_mb: int | None = None
    max_sequences: int | None = None  # sequences decoding together; None: 64, on a GPU 256
    max_batch_tokens: int = 2048  # tokens in one forward pass
    prefix_cache: bool = True
    # "numpy" | "torch"; None: the registry entry's, else torch where installed, else numpy
    backend: str | None = None
    # "cpu" | "cuda" | "cuda:N"; None: the registry entry's, else "cpu" (runtime/devices.py)
    device: str | None = None
    # the tensor forward pass (every tensor on the device); None: on CUDA devices only, and
    # True runs it on the CPU too, which is how CI tests the GPU's code path
    torch_forward: bool | None = None
    # torch's CPU kernels (runtime/kernels/cpu.py); None: the ones measured best on this CPU
    kernels: KernelPlan | None = None
    # the KV pool's share of the GPU memory free after the weights (vLLM's
    # --gpu-memory-utilization); None: $LLMQ_GPU_MEMORY_UTILIZATION, else half, at most 16 GiB
    gpu_memory_utilization: float | None = None
    # decode steps as static steps of the tensor forward pass (runtime/decode_graphs.py),
    # captured as CUDA graphs on a GPU; None: wherever the tensor forward pass runs
    decode_graphs: bool | None = None
    # LoRA adapter slots on the device (runtime/lora_slots.py), so that decode steps with
    # LoRA rows run as static (captured) steps too: how many adapters one step can use,
    # and the largest rank a slot takes (per weight, the ranks fused into it summed; q, k
    # and v are one weight). A step past either runs eagerly. They cost 4 x slots x rank x
    # (in + out) bytes per linear weight once the first adapter is used (~0.5 GB for
    # SmolLM2-135M at 8 x 64); 0 slots: LoRA rows always take the eager step
    lora_slots: int = DEFAULT_LORA_SLOTS
    lora_rank: int = DEFAULT_LORA_RANK
    # a static decode step launched before the last one's tokens are read back
    # (runtime/generator.py `Generator.step`); False: every step waits for its tokens
    overlap: bool = True


class Engine:
    """One model in memory; cheap to share between the sequences of a batch."""

    def __init__(
        self, spec: ModelSpec, gguf_file: GGUFFile, config: EngineConfig | None = None
    ) -> None:
        started = time.perf_counter()
        self.spec = spec
        self.config = config or EngineConfig()
        self.metadata = gguf_file.metadata
        self.architecture = gguf_file.architecture
        self.text = ModelText.from_file(spec, gguf_file)
        self.tokenizer = self.text.tokenizer
        placement = place(
            self.config.device or spec.device,
            self.config.torch_forward,
            self.config.backend or spec.backend,
            self.config.kernels,
        )
        self.device, self.torch_forward = placement.device, placement.torch_forward
        self.backend = placement.backend
        self.model = load_placed(gguf_file, placement, spec.id)
        self.sampler = Sampler(self.model.vocab_size, self.tokenizer.stop_ids)
        # llguidance's view of the vocabulary, built on the first constrained request
        self.grammar_vocab = GrammarVocab(self.tokenizer, self.model.vocab_size)
        with device_memory_guard(self.device, f"the KV pool of {spec.id}"):
            kv_bytes = kv_budget_bytes(
                self.config.kv_memory_mb, self.device, self.config.gpu_memory_utilization
            )
            blocks = -(-self.context_length // BLOCK_SIZE) + 1  # one sequence, and the scratch
            per_block = self.model.kv_block_bytes  # layers of their own shape (gemma4)
            check_minimal_pool(kv_bytes, blocks * per_block, self.device, spec.id)
            self.kv_pool = self.model.kv_pool_for_budget(kv_bytes)
        self.prefix_cache = (
            PrefixCache(self.kv_pool, namespace=spec.id) if self.config.prefix_cache else None
        )
        if self.prefix_cache is not None and getattr(self.model, "recurrent", False):
            # cached blocks would not bring the recurrent state their tokens left
            self.prefix_cache = None
            log.info(
                "%s: %s keeps recurrent state per sequence: no prefix cache (a preempted "
                "sequence is recomputed from its tokens)",
                spec.id,
                self.architecture,
            )
        self.decode_graphs: DecodeGraphs | None = None
        self.lora_slots: LoraSlots | None = None
        if self.torch_forward and self.config.decode_graphs is not False:
            from runtime.decode_graphs import DecodeGraphs  # torch: the tensor path's
            from runtime.lora_slots import LoraSlots

            if self.config.lora_slots:  # the eager step's LoRA rows use them too
                slots = LoraSlots(self.model, self.config.lora_slots, self.config.lora_rank)
                self.lora_slots = self.model.ops.lora_slots = slots
            # a recurrent model's state is per sequence, not in static buffers: eager steps
            if not getattr(self.model, "recurrent", False):
                self.decode_graphs = DecodeGraphs(
                    self.model, self.kv_pool, self.max_sequences, self.lora_slots
                )
                with device_memory_guard(self.device, f"the decode graphs of {spec.id}"):
                    self.decode_graphs.capture()
        self.adapters: dict[str, LoraAdapter] = {}  # LoRA adapters by name
        for name, path in spec.loras:  # the registry's adapters come with the model
            self.load_adapter(name, adapter_file(path))
        self.load_seconds = time.perf_counter() - started
        self._request_ids = itertools.count()

    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None) -> Engine:
        spec = resolve(model)
        return cls(spec, GGUFFile(spec.path()), config)

    @property
    def chat_template(self) -> ChatTemplate:
        return self.text.chat_template

    @chat_template.setter
    def chat_template(self, template: ChatTemplate) -> None:
        """Replace the template the chats of this engine render with (tests, overrides)."""
        self.text.chat_template = template

    @property
    def context_length(self) -> int:
        return min(self.config.max_context or self.model.context_length, self.model.context_length)

    @property
    def max_sequences(self) -> int:
        """Sequences decoding together: as configured, else 256 on a GPU, 64 on the CPU."""
        return self.config.max_sequences or (256 if self.device != CPU else 64)

    @property
    def nbytes(self) -> int:
        """The weights' bytes plus the loaded LoRA adapters'."""
        return self.model.nbytes + sum(a.nbytes for a in self.adapters.values())

    @property
    def device_bytes(self) -> int:
        """What this engine holds on its device: on the CPU its weights and adapters (KV
        pages are backed as they are used); on a GPU also the KV pool, allocated whole, and
        the LoRA slots once an adapter was used (runtime/lora_slots.py)."""
        if self.device == CPU:
            return self.nbytes
        on_host = self.model.embed.nbytes  # the embedding stays in the mapped file
        slots = 0 if self.lora_slots is None else self.lora_slots.nbytes
        return self.nbytes - on_host + self.kv_pool.n_blocks * self.kv_pool.block_nbytes + slots

    def load_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Load the GGUF LoRA adapter at `path` as `name` (replacing one of that name: running
        sequences keep the one they started with); `AdapterError` if it does not fit."""
        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter name must be a non-empty string, got {name!r}")
        adapter = load_adapter(name, path, self.model.linear_sources, self.model.architecture)
        self.adapters[name] = adapter
        return adapter

    def unload_adapter(self, name: str) -> bool:
        """Forget adapter `name` (sequences using it finish with it); False if not loaded."""
        return self.adapters.pop(name, None) is not None

    def adapter_stack(self, lora: Sequence[tuple[str, float]]) -> AdapterStack:
        """Adapters by (name, scale) as a stack for `Generator.add`; `AdapterNotFoundError`
        names the first one not loaded."""
        stack = []
        for name, scale in lora:
            adapter = self.adapters.get(name)
            if adapter is None:
                loaded = ", ".join(sorted(self.adapters)) or "none"
                raise AdapterNotFoundError(
                    f"LoRA adapter {name!r} is not loaded for {self.spec.id} (loaded: {loaded})"
                )
            stack.append((adapter, scale))
        return normalize_stack(stack)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return self.text.encode(text, add_special)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.text.encode_chat(messages, tools)

    def new_generator(self) -> Generator:
        return Generator(
            self.model,
            self.tokenizer,
            self.sampler,
            self.kv_pool,
            self.prefix_cache,
            max_context=self.context_length,
            config=GeneratorConfig(
                max_sequences=self.max_sequences,
                max_batch_tokens=self.config.max_batch_tokens,
                max_prefill_tokens=self.config.prefill_chunk,
                overlap=self.config.overlap,
            ),
            grammar_vocab=self.grammar_vocab,
            runner=self._step_runner(),
        )

    def _step_runner(self) -> HostSteps | DeviceSteps:
        """The runner of a new generator's steps (runtime/step_runners.py), for this
        engine's path: each generator its own, as it keeps its own grammar counts."""
        host_rows = HostRows(self.sampler, self.grammar_vocab)
        if not self.torch_forward:
            return HostSteps(host_rows)
        from runtime.device_steps import DeviceSteps  # torch: the tensor path's

        return DeviceSteps(self.model, host_rows, self.decode_graphs)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        lora: Sequence[tuple[str, float]] = (),
    ) -> Iterator[TokenEvent]:
        """Stream the events of one sequence until it finishes; `lora`: (adapter name,
        scale) pairs of loaded adapters."""
        adapters = self.adapter_stack(lora)
        generator = self.new_generator()
        request_id = f"gen-{next(self._request_ids)}"
        generator.add(request_id, prompt_ids, params, adapters=adapters)
        while len(generator):
            yield from generator.step()

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], top_n: int = 0, adapters: AdapterStack = ()
    ) -> list[tuple[float | None, list[tuple[int, float]]]]:
        """Logprob of each prompt token given the ones before it (None for the first), with
        the `top_n` most likely alternatives at that position: what `echo` + `logprobs` return
        (computed with the LoRA `adapters` of the request, if any).
        """
        self.new_generator().check_request(prompt_ids, SamplingParams(max_tokens=1))
        ids = list(prompt_ids)
        cache = self.model.new_cache(len(ids))
        out: list[tuple[float | None, list[tuple[int, float]]]] = [(None, [])]
        for start in range(0, len(ids), self.config.prefill_chunk):
            piece = ids[start : start + self.config.prefill_chunk]
            layout = BatchLayout([SequenceChunk(cache, start, len(piece), adapters)])
            hidden = self.model.forward(np.asarray(piece), layout)
            logits = self.model.ops.to_host(self.model.logits(hidden, True))  # [n, V]
            logprobs = logits - _logsumexp(logits)[:, None]
            for row, position in enumerate(range(start, start + len(piece))):
                if position + 1 >= len(ids):
                    break
                top = np.argsort(-logprobs[row], kind="stable")[:top_n]
                alternatives = [(int(t), float(logprobs[row, t])) for t in top]
                out.append((float(logprobs[row, ids[position + 1]]), alternatives))
        return out

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Mean-pooled final hidden states, L2-normalised: `[N, D]`, one forward pass each."""
        vectors = []
        for ids in inputs:
            if not ids:
                raise EmptyPromptError("an embedding input is empty: it needs at least one token")
            probe = self.new_generator()
            probe.check_request(ids, SamplingParams(max_tokens=1))
            vectors.append(self._pooled(list(ids)))
        return np.stack(vectors)

    def _pooled(self, ids: list[int]) -> np.ndarray:
        cache = self.model.new_cache(len(ids))
        pooled = np.zeros(self.model.hidden_size, np.float64)
        for start in range(0, len(ids), self.config.prefill_chunk):
            piece = ids[start : start + self.config.prefill_chunk]
            layout = BatchLayout([SequenceChunk(cache, start, len(piece))])
            hidden = self.model.ops.to_host(self.model.forward(np.asarray(piece), layout))
            pooled += hidden.sum(axis=0)  # [n, D] -> [D]
        pooled /= len(ids)
        norm = np.linalg.norm(pooled)
        return (pooled / norm if norm > 0 else pooled).astype(np.float32)


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=-1)
    return peak + np.log(np.exp(logits - peak[:, None]).sum(axis=-1))
