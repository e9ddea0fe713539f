"""Tiny random-weight checkpoints with a locally trained tokenizer: the default model of example.py
and the fixtures of the tests. Nothing is downloaded."""
import json
import os
import shutil
import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          PreTrainedTokenizerFast)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = (
    "Hello, my name is nano and I like to infer. The quick brown fox jumps over the lazy dog. "
    "Large language models predict the next token from the tokens before it. A paged KV cache stores "
    "keys and values in fixed-size blocks. Prefix caching reuses blocks that hold the same tokens. "
    "Tensor parallelism splits each layer across devices. Once upon a time there was a small engine "
    "that served many requests at once. Naïve café résumé — 你好，世界！ emoji 🙂 numbers 0123456789. "
    "list all prime numbers within 100; introduce yourself; what is the capital of France? Paris. "
)


def train_tokenizer(vocab_size: int = 384):

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def build_tiny_checkpoint(path: str, arch: str = "qwen3", hidden_size: int = 64, num_layers: int = 2,
                          num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                          intermediate_size: int = 128, vocab_size: int | None = None,
                          tie_word_embeddings: bool = True, max_position_embeddings: int = 4096,
                          seed: int = 0, dtype: str = "float32", attention_bias: bool = False,
                          mlp_bias: bool = False, llama3_rope: bool = False) -> str:
    """Write an HF checkpoint (config, safetensors, tokenizer, generation_config) to `path`.
    vocab_size defaults to the tokenizer's size; a larger one pads the embedding like real models."""

    tokenizer = train_tokenizer()
    vocab_size = vocab_size or len(tokenizer)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  initializer_range=0.1, rms_norm_eps=1e-6, rope_theta=10000.0,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    if arch == "qwen3":
        config = Qwen3Config(head_dim=head_dim or hidden_size // num_heads, attention_bias=attention_bias, **common)
        model_cls = Qwen3ForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(**common)
        model_cls = Qwen2ForCausalLM
    elif arch == "llama":
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64) if llama3_rope else None
        config = LlamaConfig(head_dim=head_dim or hidden_size // num_heads, attention_bias=attention_bias,
                             mlp_bias=mlp_bias, **common)
        if rope:
            config.rope_parameters = rope
        model_cls = LlamaForCausalLM
    else:
        raise ValueError(f"arch must be 'qwen3', 'qwen2' or 'llama', got {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    if arch == "qwen2" or attention_bias or mlp_bias:  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return path


def default_tiny_model_dir() -> str:
    """The built-in tiny Qwen3 checkpoint, built once into the user's cache directory."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    path = os.path.join(cache, "nanoinfer", "tiny-qwen3-v1")
    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        # built beside and renamed into place: a process starting at the same time (two test workers,
        # two example runs) never reads a half-written checkpoint
        os.makedirs(os.path.dirname(path), exist_ok=True)
        built = build_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny-qwen3-v1.", dir=os.path.dirname(path)))
        if os.path.isdir(path) and not os.path.isfile(weights):  # left half-written by an older version
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(built, path)
        except OSError:  # another process put its copy there first
            shutil.rmtree(built, ignore_errors=True)
    return path
