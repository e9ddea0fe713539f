"""Tiny random-weight Qwen3-MoE, Mixtral and Mistral checkpoints (HF's own config and model classes,
saved by HF, so the expert tensors have the names real checkpoints use), with tiny_model's locally
trained tokenizer. Nothing is downloaded."""
import json
import os

import torch
from transformers import (MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from nanoinfer.utils.tiny_model import train_tokenizer


def build_tiny_moe_checkpoint(path: str, arch: str = "qwen3_moe", hidden_size: int = 64, num_layers: int = 2,
                              num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                              intermediate_size: int = 96, moe_intermediate_size: int = 32, num_experts: int = 8,
                              top_k: int = 2, norm_topk_prob: bool = True, decoder_sparse_step: int = 1,
                              mlp_only_layers: tuple[int, ...] = (), tie_word_embeddings: bool = False,
                              sliding_window: int | None = None, max_position_embeddings: int = 4096,
                              seed: int = 0) -> str:
    """Write an HF checkpoint to `path`. arch: "qwen3_moe" (experts of moe_intermediate_size, dense
    layers of intermediate_size), "mixtral" (experts of intermediate_size) or "mistral" (dense)."""

    tokenizer = train_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim or hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, initializer_range=0.1, rms_norm_eps=1e-6,
                  rope_theta=10000.0, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
                                num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                                decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
                                **common)
        model_cls = Qwen3MoeForCausalLM
    elif arch == "mixtral":
        config = MixtralConfig(num_local_experts=num_experts, num_experts_per_tok=top_k,
                               sliding_window=sliding_window, **common)
        model_cls = MixtralForCausalLM
    elif arch == "mistral":
        config = MistralConfig(sliding_window=sliding_window, **common)
        model_cls = MistralForCausalLM
    else:
        raise ValueError(f"arch must be 'qwen3_moe', 'mixtral' or 'mistral', got {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(config).float()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tokenizer.eos_token_id]}, f)
    return path


def default_tiny_moe_dir() -> str:
    """The built-in tiny Qwen3-MoE checkpoint (8 experts, top-2), built once into the user's cache
    directory (bench.py --config builtin-tiny-moe: expert parallelism on a CPU)."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    path = os.path.join(cache, "nanoinfer", "tiny-qwen3-moe-v1")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_tiny_moe_checkpoint(path)
    return path
