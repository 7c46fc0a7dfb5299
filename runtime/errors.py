"""Named exceptions of the runtime. Every error a user can cause has a class here.

Messages say what was wrong and what was expected, so a CLI or API can show them as-is;
`param` names the request field an error is about (OpenAI's `param`), set where it is
raised, so nobody has to guess it from the message.
"""

from __future__ import annotations


class LLMQRuntimeError(Exception):
    """Base of every error the engine raises on purpose."""

    param: str | None = None  # the request field the error is about, if any

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        if param is not None:
            self.param = param


class ModelNotFoundError(LLMQRuntimeError):
    """A model id or path that the registry cannot resolve to a GGUF file."""


class ModelFormatError(LLMQRuntimeError):
    """A GGUF file that is corrupt, truncated, or uses an unsupported architecture or type."""


class ContextLengthError(LLMQRuntimeError):
    """Prompt plus requested tokens do not fit the model's context window."""


def check_context_length(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Raise `ContextLengthError` when a prompt plus its completion exceed the context:
    the words every place that checks it uses (the API at submission, the generator)."""
    total = prompt_tokens + max_tokens
    if total > max_context:
        raise ContextLengthError(
            f"this model's maximum context length is {max_context} tokens, but "
            f"{total} were requested ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion); shorten the prompt or max_tokens"
        )


class EmptyPromptError(LLMQRuntimeError):
    """A prompt with no tokens to condition on."""

    param = "prompt"


class InvalidSamplingParams(LLMQRuntimeError, ValueError):
    """A sampling option out of range or of the wrong type; the message names field and value."""


class TokenizerError(LLMQRuntimeError):
    """Tokenizer metadata in a GGUF that is missing, inconsistent, or of an unsupported kind."""


class UnsupportedTokenizerError(TokenizerError):
    """`tokenizer.ggml.model` names a tokenizer llmq cannot build (only gpt2 and llama are)."""


class InvalidTokenIdError(TokenizerError, ValueError):
    """A token id outside `[0, vocab_size)` passed to decode or detokenize."""


class ChatTemplateError(LLMQRuntimeError):
    """Base of the chat-template failures; the message says which model and what went wrong."""

    param = "messages"


class ChatTemplateMissingError(ChatTemplateError):
    """The model ships no `tokenizer.chat_template` and no override was configured."""


class ChatTemplateRenderError(ChatTemplateError):
    """The template failed while rendering, including its own `raise_exception(...)` calls."""


class InvalidChatMessagesError(ChatTemplateError, ValueError):
    """Chat messages of the wrong shape: roles must be str, content str or a list of text parts."""


class ChatTemplateSyntaxError(ChatTemplateError):
    """The model's chat template is not valid Jinja; raised on use so the model still loads."""


class AdapterError(LLMQRuntimeError):
    """A LoRA adapter file that is not one, or does not fit the model it is loaded on."""

    param = "lora"


class AdapterNotFoundError(AdapterError):
    """A request names a LoRA adapter that is not loaded on this engine."""
