"""A real reference for an architecture: a tiny transformers model with random float32
weights, converted by llama.cpp's own convert_hf_to_gguf.py (the vendored copy under
build/), and transformers' float32 logits on the same weights.

The converter is run with a byte-level vocabulary for every architecture: our tiny
tokenizer's pre-tokenizer hash is not in its table, and the vocabulary does not change
the logits. Everything else (tensor names, which q/k rows it permutes, the keys it
writes) is the converter's own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP = REPO / "build/llama-cpp-python-src/llama_cpp_python-0.3.36/vendor/llama.cpp"
VOCAB = 320
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
LONGROPE = dict(
    type="longrope",
    short_factor=[1.0 + 0.1 * i for i in range(6)],
    long_factor=[1.0 + 0.5 * i for i in range(6)],
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
PHI3 = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=None)
# name -> (transformers config class name, its arguments): each exercises its variant
CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", dict(BASE, head_dim=24, rope_theta=1e6)),
    "qwen3-yarn": ("Qwen3Config", dict(BASE, head_dim=24, rope_theta=1e6, rope_scaling=YARN)),
    "qwen2": ("Qwen2Config", dict(BASE, rope_theta=1e6, tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", dict(BASE, rope_theta=5e5, rope_scaling=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(BASE, head_dim=24, sliding_window=None)),
    # Ministral 3: YaRN (mscale and mscale_all_dim 1) and Llama 4's attention temperature
    "ministral3": (
        "Ministral3Config",
        dict(
            BASE,
            head_dim=24,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e6,
                factor=4.0,
                original_max_position_embeddings=32,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                llama_4_scaling_beta=0.1,
            ),
        ),
    ),
    "phi3": ("Phi3Config", dict(BASE, **PHI3)),
    "phi3-longrope": (
        "Phi3Config",
        dict(
            BASE,
            **PHI3,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=64,
            rope_scaling=LONGROPE,
        ),
    ),
    # llama.cpp scales q by 1/sqrt(head size) below the 27B, so query_pre_attn_scalar = 16
    "gemma2": (
        "Gemma2Config",
        dict(
            BASE,
            head_dim=16,
            num_hidden_layers=4,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
    "smollm3": ("SmolLM3Config", dict(BASE, num_hidden_layers=4, pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict(BASE, pad_token_id=0)),
    "olmo3": ("Olmo3Config", dict(BASE, num_hidden_layers=4, pad_token_id=0, sliding_window=8)),
    # one base for both kinds of layer: llama.cpp's olmo2 graph rotates sliding layers with
    # the main base whatever rope.freq_base_swa says
    "olmo3-yarn": (
        "Olmo3Config",
        dict(
            BASE,
            num_hidden_layers=4,
            pad_token_id=0,
            sliding_window=8,
            rope_parameters={
                "full_attention": dict(YARN, rope_theta=5e5),
                "sliding_attention": dict(rope_type="default", rope_theta=5e5),
            },
        ),
    ),
    "granite": (
        "GraniteConfig",
        dict(
            BASE,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.03,
            logits_scaling=8.0,
        ),
    ),
}

# convert_hf_to_gguf.py run with a byte-level vocabulary (see the docstring), as `python -c`
CONVERT = """
import sys
sys.path.insert(0, {llama!r} + "/gguf-py")
sys.path.insert(0, {llama!r})
import conversion.base as base
import convert_hf_to_gguf

# a reduced vocabulary's pre-tokenizer hash is in no table: name one
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
prepare_metadata = base.TextModel.prepare_metadata


def byte_level_vocab(self, *args, **kwargs):
    # over every architecture's own set_vocab (sentencepiece for gemma)
    self.set_vocab = self._set_vocab_gpt2
    return prepare_metadata(self, *args, **kwargs)


base.TextModel.prepare_metadata = byte_level_vocab
convert_hf_to_gguf.main()
"""


def convert(
    folder: Path, out: Path, outtype: str, *extra: str, llama_cpp: Path = LLAMA_CPP
) -> None:
    """llama.cpp's convert_hf_to_gguf.py on a Hugging Face folder, to `out` in `outtype`
    (`extra`: more of its options), with the byte-level vocabulary; also the converter of
    tests/fixtures/make_arch_models.py and bench/cold_load.py."""
    script = CONVERT.format(llama=str(llama_cpp))
    # a name of its own: llama.cpp's vocabulary treats a model named "phi3" specially
    args = [str(folder), "--outtype", outtype, "--outfile", str(out), "--model-name", "tiny"]
    done = subprocess.run(
        [sys.executable, "-c", script, *args, *extra], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder.name}:\n{done.stderr[-3000:]}")


def _save_tokenizer(d: Path) -> None:
    """A byte-level BPE tokenizer (256 bytes, 3 specials, 3 merges) for the converter."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[token] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    end = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=end, bos_token=end).save_pretrained(d)


def _randomize(model, seed: int) -> None:
    """Weights of a trained model's scale: transformers' init (std 0.02) gives logits too
    small to tell a wrong layer from a right one."""
    import torch

    gemma = "gemma" in type(model).__name__.lower()  # its norms are (1 + w)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            elif "bias" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)


def build(name: str, out_dir: Path) -> tuple[Path, Path]:
    """The HF checkpoint of CONFIGS[name] and its GGUF (f32) converted by llama.cpp."""
    import torch
    import transformers

    class_name, kwargs = CONFIGS[name]
    hf_dir, gguf_path = out_dir / name, out_dir / f"{name}.gguf"
    config = getattr(transformers, class_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=0)
    model.save_pretrained(hf_dir)
    _save_tokenizer(hf_dir)
    convert(hf_dir, gguf_path, "f32")
    return hf_dir, gguf_path


def hf_logits(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 logits `[n, V]` for one sequence (eager attention)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor(tokens)[None]).logits[0].numpy()
