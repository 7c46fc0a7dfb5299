"""A model's text side without its weights: tokenizer, chat template, context length.

The API checks a generation request completely at submission with it (an over-long
prompt, a token id outside the vocabulary, chat on a model without a template are the
user's mistakes: a 400 then, never a failed job), and the engine holds one for the same
encoding. Building it reads the GGUF's header (metadata and vocabulary), never a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from runtime.chat_formats import HERMES
from runtime.chat_template import ChatTemplate
from runtime.constraints import validate_constraint
from runtime.errors import EmptyPromptError, InvalidSamplingParams, check_context_length
from runtime.gguf_file import GGUFFile
from runtime.grammar_vocab import GrammarVocab
from runtime.registry import ModelSpec, resolve
from runtime.request import GenerationSpec
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import chat_for_template


@dataclass
class ModelText:
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    context_length: int  # what the model was trained for; a worker may serve less

    @classmethod
    def from_file(cls, spec: ModelSpec, gguf: GGUFFile) -> ModelText:
        tokenizer = Tokenizer.from_metadata(gguf.metadata)
        template = spec.chat_template or gguf.metadata.get("tokenizer.chat_template")
        return cls(
            tokenizer,
            ChatTemplate(template, tokenizer, model_name=spec.id),
            int(gguf.require("context_length")),
        )

    @classmethod
    def load(cls, model: str) -> ModelText:
        """The text side of a registry id or .gguf path (raises ModelNotFoundError)."""
        spec = resolve(model)
        return cls.from_file(spec, GGUFFile(spec.path()))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @cached_property
    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as llguidance reads it, as the engine's (built on first use)."""
        return GrammarVocab(self.tokenizer, self.vocab_size)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render with the model's chat template; the template itself writes BOS if it wants.
        `tools` (OpenAI function tools) are shown to the model by the template when it knows
        how, else by the fallback of `runtime.tool_calls`, which also writes past tool calls
        and results for such templates."""
        return self.tokenizer.encode(
            self.chat_prompt(messages, tools), add_special=False, parse_special=True
        )

    def chat_prompt(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The text `encode_chat` tokenizes: what the template makes of the conversation."""
        template = self.chat_template
        messages, extra = chat_for_template(messages, tools, template.knows_tools, template.format)
        return self.chat_template.render(messages, add_generation_prompt=True, **extra)

    def prompt_ids(self, prompt: str | list[int], name: str = "prompt") -> list[int]:
        """One prompt (text, or token ids checked against the vocabulary) as token ids."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EmptyPromptError(f"{name} is empty: it needs at least one token", param=name)
            return self.encode(prompt)
        if not prompt:
            raise EmptyPromptError(f"{name} is empty: it needs at least one token", param=name)
        for token_id in prompt:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidSamplingParams(
                    f"{name} token id {token_id} is out of range for a vocabulary of "
                    f"{self.vocab_size} tokens.",
                    param=name,
                )
        return list(prompt)

    def check(self, spec: GenerationSpec, max_context: int | None = None) -> int:
        """Raise the error the engine would give this request (with its field), before any
        weights are involved; the prompt tokens of one choice of each prompt, summed."""
        context = min(max_context or self.context_length, self.context_length)
        if spec.chat:
            assert spec.messages is not None
            prompts = [self.encode_chat(spec.messages, spec.prompt_tools)]
        else:
            prompts = [self.prompt_ids(p) for p in spec.prompts or []]
        for ids in prompts:
            max_tokens = spec.max_tokens
            if max_tokens is None:  # chat's default: whatever the context leaves, at least 1
                max_tokens = max(1, context - len(ids))
            check_context_length(len(ids), max_tokens, context)
            for params in spec.choice_params(max_tokens, self.chat_template.format):
                params.check_vocab(self.vocab_size)
        self._check_tool_grammar(spec)
        return sum(len(ids) for ids in prompts)

    def _check_tool_grammar(self, spec: GenerationSpec) -> None:
        """Compile the tool-call grammar the worker compiles: in the model's family's format,
        its control-token markers named by id (which only the vocabulary can check); a
        model-less check (api/schemas.py) compiled Hermes's only."""
        fmt = self.chat_template.format
        if fmt.family == HERMES or spec.constraint is not None or not spec.calls_possible:
            return
        constraint = spec.output_constraint(fmt)
        assert constraint is not None
        validate_constraint(constraint, self.grammar_vocab)
