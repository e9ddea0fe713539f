"""The limits a model config's numbers must keep, checked before anything is allocated (a ValueError
naming the field and its allowed range, instead of an allocator error or a model that loads and
computes NaN):
- every size at most a documented cap, far above any released model (`MAX_SIZES`);
- rms_norm_eps and rope_theta positive and finite, and llama3 RoPE's factors usable;
- the weights' bytes, estimated from the config, and the RoPE cache within the memory of the device
  each rank runs on (`check_fits_memory`, run by build_model before it allocates).
Only the standard library and torch: config.py runs these without building any layer."""
import math
import os
from numbers import Real

import torch
from transformers import PretrainedConfig

# Generous caps (the largest released models use hidden 16384 and 18432, a vocabulary of 262144,
# 126 layers, 128 heads of dim 256, MLPs of 53248 and 384 experts); each keeps the tensors' indices
# and a single layer far inside int64 and the memory of one host.
MAX_SIZES = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 30, "num_experts": 1 << 14, "num_local_experts": 1 << 14,
    "moe_intermediate_size": 1 << 20,
}


def rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_scaling(config: PretrainedConfig) -> dict | None:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_size_caps(config: PretrainedConfig):
    for name, cap in MAX_SIZES.items():
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            raise ValueError(f"model config: {name} must be in [1, {cap}], got {value}")


def _positive_finite(name: str, value) -> float:
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"model config: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_norm_and_rope(config: PretrainedConfig):
    """rms_norm_eps > 0 (0 or less divides by zero or takes the root of a negative: NaN everywhere);
    rope_theta > 0 (0 gives inf/NaN frequencies); llama3 scaling: factors > 0, high > low."""
    _positive_finite("rms_norm_eps", getattr(config, "rms_norm_eps", None))
    params = getattr(config, "rope_parameters", None) or {}
    raw_theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    _positive_finite("rope_theta", raw_theta)
    scaling = rope_scaling(config) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "llama3":
        return
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        _positive_finite(f"rope_parameters.{name}", scaling.get(name))
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"model config: rope_parameters.high_freq_factor must be > low_freq_factor="
                         f"{scaling['low_freq_factor']}, got {scaling['high_freq_factor']}")


def _mlp_elements(config: PretrainedConfig, arch: str) -> int:
    """The MLP weights of every layer: dense, or the experts (and router) of the sparse layers."""
    h, layers = config.hidden_size, config.num_hidden_layers
    dense = 3 * h * config.intermediate_size
    if arch == "MixtralForCausalLM":
        return layers * config.num_local_experts * (dense + h)
    if arch != "Qwen3MoeForCausalLM":
        return layers * dense
    only = set(config.mlp_only_layers or [])
    sparse = sum(1 for i in range(layers) if i not in only and (i + 1) % config.decoder_sparse_step == 0)
    experts = config.num_experts * (3 * h * config.moe_intermediate_size + h)
    return (layers - sparse) * dense + sparse * experts


def weight_parts(config: PretrainedConfig, arch: str) -> tuple[int, int, int]:
    """(embedding and LM head, other linear layers, MoE experts and routers) weight elements the
    config implies (norms and biases left out: a lower bound)."""
    h, d = config.hidden_size, head_dim(config)
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    embed = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    attention = config.num_hidden_layers * (h * (q + 2 * kv) + q * h)
    mlp = _mlp_elements(config, arch)
    experts = mlp - _mlp_elements_dense_only(config, arch)
    return embed, attention + mlp - experts, experts


def _mlp_elements_dense_only(config: PretrainedConfig, arch: str) -> int:
    """The dense MLP layers' share of _mlp_elements (all of it for a dense model)."""
    if arch == "MixtralForCausalLM":
        return 0
    if arch != "Qwen3MoeForCausalLM":
        return _mlp_elements(config, arch)
    only = set(config.mlp_only_layers or [])
    sparse = sum(1 for i in range(config.num_hidden_layers)
                 if i not in only and (i + 1) % config.decoder_sparse_step == 0)
    return (config.num_hidden_layers - sparse) * 3 * config.hidden_size * config.intermediate_size


def weight_elements(config: PretrainedConfig, arch: str) -> int:
    """The number of weight elements the config implies (norms and biases left out: a lower bound)."""
    return sum(weight_parts(config, arch))


def weight_bytes(config: PretrainedConfig, arch: str, dtype: torch.dtype, fp8: bool = False,
                 fp8_experts: bool = False) -> int:
    """The weights' bytes: with fp8 the linear layers' weights take one byte each, with fp8_experts the
    MoE experts' too (scales left out: a lower bound); the rest (embedding, LM head) the model's dtype."""
    embed, linear, experts = weight_parts(config, arch)
    return (embed * dtype.itemsize + linear * (1 if fp8 else dtype.itemsize)
            + experts * (1 if fp8_experts else dtype.itemsize))


def _memory_bytes(device: torch.device, tp: int) -> tuple[int, str]:
    """What one rank can hold: its GPU's memory, or on CPU its share of the host's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"GPU memory on {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // tp, f"host RAM per rank ({tp} rank(s))"


def check_fits_memory(config: PretrainedConfig, arch: str, dtype: torch.dtype, device: torch.device, tp: int,
                      max_model_len: int, fp8: bool = False, fp8_experts: bool = False):
    """Refuse, before allocating, a model whose weights (one rank's share) and RoPE cache cannot fit
    on `device` (run by build_model in the rank's own process, where the device is in use anyway).
    fp8 / fp8_experts: the linear layers / MoE experts hold FP8 weights (weight_bytes)."""
    weights = weight_bytes(config, arch, dtype, fp8, fp8_experts) // tp
    rope = max_model_len * head_dim(config) * 4  # float32 cos and sin, one cache per model
    bound, what = _memory_bytes(torch.device(device), tp)
    if weights + rope > bound:
        gib = 1 << 30
        raise ValueError(
            f"model config: the weights take about {weights / gib:.1f} GiB per rank in {dtype}"
            f"{' (FP8 linear layers)' if fp8 else ''} and the RoPE "
            f"cache {rope / gib:.1f} GiB (vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
            f"intermediate_size={config.intermediate_size}, num_hidden_layers={config.num_hidden_layers}, "
            f"max_model_len={max_model_len}), more than the {bound / gib:.1f} GiB of {what}")
