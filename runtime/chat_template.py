"""Render a model's chat template (GGUF `tokenizer.chat_template`) the way Hugging Face does.

Same Jinja setup as transformers' `apply_chat_template`: a sandboxed, immutable environment
with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that
does not HTML-escape, and the globals `raise_exception` and `strftime_now`. The template
text comes from the GGUF file, so it is treated as untrusted and never leaves the sandbox.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.chat_formats import ChatFormat
from runtime.errors import (
    ChatTemplateMissingError,
    ChatTemplateRenderError,
    ChatTemplateSyntaxError,
    InvalidChatMessagesError,
)

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer

# Python errors a template can provoke on bad data (e.g. `None + str`), reported as ours.
_TEMPLATE_FAILURES = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    LookupError,
    ArithmeticError,
    AttributeError,
)


class ChatTemplate:
    """One model's compiled chat template; build once per model and reuse.

    `source` None means the model has none: construction still succeeds (the model can serve
    plain completions) and `render` raises `ChatTemplateMissingError`. A template that does
    not compile raises `ChatTemplateSyntaxError` on `render`, for the same reason.
    """

    def __init__(
        self,
        source: str | None,
        tokenizer: Tokenizer | None = None,
        *,
        model_name: str = "this model",
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.source = source
        self.model_name = model_name
        self.bos_token = bos_token if bos_token is not None else _token(tokenizer, "bos_id")
        self.eos_token = eos_token if eos_token is not None else _token(tokenizer, "eos_id")
        self._template: jinja2.Template | None = None
        self._syntax_error: jinja2.TemplateSyntaxError | None = None
        self.knows_tools = False
        """Whether the template renders a `tools` variable itself (else tool calling uses
        the Hermes-style fallback of `runtime.tool_calls`)."""
        self.format = ChatFormat.of(source, tokenizer)
        """The family its answers' tool calls and thinking are written in, told from the
        template's text once (`runtime.chat_formats`)."""
        if source is not None:
            try:
                env = self._environment()
                self._template = env.from_string(source)
                self.knows_tools = "tools" in jinja2.meta.find_undeclared_variables(
                    env.parse(source)
                )
            except jinja2.TemplateSyntaxError as exc:
                self._syntax_error = exc

    @property
    def available(self) -> bool:
        """True when `render` can work: a template exists and it compiled."""
        return self._template is not None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; extra kwargs (e.g. `tools`) become template vars."""
        messages = normalize_messages(messages)
        if not self.supports_system_role:
            messages = system_into_user(messages)
        return self._render(messages, add_generation_prompt, **kwargs)

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        template = self._compiled()
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except _TEMPLATE_FAILURES as exc:
            raise ChatTemplateRenderError(
                f"the chat template of {self.model_name} failed: {type(exc).__name__}: {exc}"
            ) from exc

    @functools.cached_property
    def supports_system_role(self) -> bool:
        """Whether the template shows a system message at all: llama.cpp renders a probe
        and, where its text is lost (Phi-3, Orion) or the template refuses the role (Gemma,
        Mistral's first templates), puts system text into the next user message instead."""
        if self._template is None:
            return True
        probe = [{"role": "system", "content": _NEEDLE}, {"role": "user", "content": "Hey"}]
        try:
            return _NEEDLE in self._render(probe, add_generation_prompt=False)
        except ChatTemplateRenderError:
            return False

    def _compiled(self) -> jinja2.Template:
        if self._template is not None:
            return self._template
        if self._syntax_error is not None:
            raise ChatTemplateSyntaxError(
                f"the chat template of {self.model_name} is not valid Jinja: "
                f"{self._syntax_error.message} (line {self._syntax_error.lineno})"
            )
        raise ChatTemplateMissingError(
            f"{self.model_name} has no chat template (no tokenizer.chat_template in its GGUF); "
            "use a plain completion or configure a template for it"
        )

    def _environment(self) -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlocks]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = self._raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env

    def _raise_exception(self, message: str) -> NoReturn:
        raise ChatTemplateRenderError(f"the chat template of {self.model_name} says: {message}")


_NEEDLE = "<System Needle>"


def system_into_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages' text moved to the start of the next user message (joined by a
    newline), as llama.cpp does for a template without a system role; text left after the
    last user message becomes a user message of its own."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for message in messages:
        if message.get("role") == "system":
            pending.append(str(message.get("content") or ""))
            continue
        if message.get("role") == "user" and pending:
            message = {**message, "content": "\n".join([*pending, message.get("content") or ""])}
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": "\n".join(pending)})
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies of `messages` whose list-of-parts content is joined into one string."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidChatMessagesError(
            f"messages must be a list of objects; got {type(messages).__name__}"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidChatMessagesError(
                f"messages[{i}] must be an object with 'role' and 'content'; "
                f"got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidChatMessagesError(
                f"messages[{i}].role must be a string; got {type(role).__name__}"
            )
        out.append({**message, "content": _content(message, i)})
    return out


def _content(message: Mapping[str, Any], i: int) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("tool_calls"):
        return None  # an assistant turn that only calls tools
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for k, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise InvalidChatMessagesError(
                    f"messages[{i}].content[{k}] must be {{'type': 'text', 'text': ...}}; "
                    "only text parts are supported"
                )
            if not isinstance(part.get("text"), str):
                raise InvalidChatMessagesError(f"messages[{i}].content[{k}].text must be a string")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidChatMessagesError(
        f"messages[{i}].content must be a string or a list of text parts; "
        f"got {type(content).__name__}"
    )


def _token(tokenizer: Tokenizer | None, attr: str) -> str:
    token_id = getattr(tokenizer, attr, None) if tokenizer is not None else None
    return tokenizer.token_text(token_id) if tokenizer is not None and token_id is not None else ""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <, > and &; chat templates want plain JSON. A filter
    # chain (`tools | map(attribute='function')`) hands over a generator: a JSON list, as
    # llama.cpp's engine writes it.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_list,
    )


def _json_list(value: Any) -> list[Any]:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens
    with it for training masks; LFM2.5 and Laguna templates use it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def has_chat_template(model: str) -> bool:
    """Whether `model` (a registry id or a .gguf path) can render chats: its registry
    entry's template, else its GGUF's own, and the template compiles. Reads the file's
    header, never its weights, so a worker can say which of its models take chat requests
    before loading them (the dashboard offers chat only for those)."""
    from runtime.gguf_file import GGUFFile  # the header reader: imported only when asked
    from runtime.registry import resolve

    spec = resolve(model)
    source = spec.chat_template or GGUFFile(spec.path()).metadata.get("tokenizer.chat_template")
    return ChatTemplate(source).available
