"""llama.cpp's pre-tokenizers: the regexes a byte-level BPE vocabulary splits text with
before merging, by the name a GGUF gives in `tokenizer.ggml.pre`.

Each entry is the list of llama.cpp's `llm_tokenizer_bpe` (src/llama-vocab.cpp) for that
name's pre-type, applied in turn: each regex splits the pieces the previous one produced,
keeping unmatched gaps as pieces. The long literals below are llama.cpp's own, C escapes
undone; the names are those its `llama_vocab::load` maps to each pre-type. What llmq does
with them is checked against llama.cpp's tokenizer test vectors
(tests/runtime/test_vocab_vectors.py).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_CHATGLM4 = (_LLAMA3,)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)
_DEEPSEEK_LLM = (
    "[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-\ud7ff]+",
    r"\p{N}+",
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)
_DEEPSEEK_CODER = (
    "[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[一-龥ࠀ-一가-\ud7ff]+",
    r"\p{N}",
)
_FALCON = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    "[0-9][0-9][0-9]",
)
_QWEN35 = (
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)
_BLOOM = (r" ?[^(\s|.,!?…。，、।۔،)]+",)
_VIKING = (
    r" ?[^(\s|.,!?…。，、।۔،)]+",
    r"\p{N}",
)
_TEKKEN = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)
_GPT4O = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)
_SEED_CODER = (
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)
_TINY_AYA = (
    r"\d{1,3}(?=(?:\d{3})*\b)",
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)
_BAILINGMOE = (
    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",  # noqa: E501 (llama.cpp literal)
)

_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("default",): _DEFAULT,
    ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "trillion", "exaone4"): (
        _GPT2,
    ),
    ("granite-docling", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "gigachat"): (_GPT2,),
    ("a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code"): (_GPT2,),
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"): (
        _DIGITS_THEN_GPT2
    ),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"): (_LLAMA3,),
    ("lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"): (_LLAMA3,),
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez"): (_QWEN2,),
    ("hunyuan", "grok-2"): (_QWEN2,),
    ("qwen35",): _QWEN35,
    ("deepseek-llm",): _DEEPSEEK_LLM,
    ("deepseek-coder",): _DEEPSEEK_CODER,
    ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"): _DEEPSEEK_V3,
    ("falcon",): _FALCON,
    ("poro-chat", "bloom", "gpt3-finnish"): _BLOOM,
    ("viking",): _VIKING,
    ("chatglm-bpe", "glm4", "glm5"): _CHATGLM4,
    ("tekken",): _TEKKEN,
    ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"): _GPT4O,
    ("seed-coder",): _SEED_CODER,
    ("tiny_aya", "cohere2moe"): _TINY_AYA,
    ("bailingmoe", "bailingmoe2", "llada-moe"): _BAILINGMOE,
}
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    name: regexes for names, regexes in _NAMES.items() for name in names
}
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")
_LLAMA3_NAMES += ("midm-2.0", "lfm2", "jina-v5-nano")
# llama.cpp's `ignore_merges`: a whole pre-token found in the vocabulary skips merging
IGNORE_MERGES = frozenset(_LLAMA3_NAMES + ("tekken", "glm4", "glm5"))
# pre-types whose vocabularies add BOS unless the GGUF says otherwise
ADD_BOS_BY_DEFAULT = frozenset(_LLAMA3_NAMES + ("tekken",))


def pre_tokenizer(name: str | None) -> tuple[tuple[str, ...], str]:
    """(regexes, the name they are known by) for a GGUF's `tokenizer.ggml.pre`."""
    if not name:
        # llama.cpp's own choice for a missing name; it warns the same way.
        log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        return PRE_TOKENIZERS["default"], "default"
    if name not in PRE_TOKENIZERS:
        log.warning("unknown pre-tokenizer %r; falling back to gpt2 (tokens may differ)", name)
        return PRE_TOKENIZERS["gpt2"], "gpt2"
    return PRE_TOKENIZERS[name], name
