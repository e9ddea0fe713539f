"""HF `architectures` name -> our model class, and the config checks made before any layer is built
(models/build.py builds and loads one rank's model). The numeric limits (size caps, eps and
theta, the weights against the memory) are models/config_limits.py's."""
import importlib

from transformers import PretrainedConfig

from nanoinfer.models.config_limits import check_norm_and_rope, check_size_caps
from nanoinfer.multimodal.config import check_vision_config

MODELS = {
    "Qwen3ForCausalLM": ("nanoinfer.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("nanoinfer.models.qwen3", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("nanoinfer.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("nanoinfer.models.mixtral", "MistralForCausalLM"),
    "Qwen3MoeForCausalLM": ("nanoinfer.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("nanoinfer.models.mixtral", "MixtralForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("nanoinfer.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("nanoinfer.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
}


def check_architecture(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            _check_sizes(config)
            check_size_caps(config)
            check_norm_and_rope(config)
            _check_supported_options(config)
            _check_moe_and_window(config, arch)
            if getattr(config, "vision_config", None) is not None:
                check_vision_config(config)
            return arch
    raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
                     f"supported: {', '.join(sorted(MODELS))}")


def _check_sizes(config: PretrainedConfig):
    """The config's own sizes, before any layer is built from them (HF accepts num_attention_heads=0)."""
    names = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings"]
    if getattr(config, "head_dim", None) is not None:
        names.append("head_dim")
    for name in names:
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model config: {name} must be a positive int, got {value!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise ValueError(f"model config: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    if config.max_position_embeddings < 2:  # max_model_len is clipped to it and must hold a prompt and a token
        raise ValueError(f"model config: max_position_embeddings must be >= 2, got {config.max_position_embeddings}")


def _check_supported_options(config: PretrainedConfig):
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: 'default' and 'llama3' RoPE are implemented")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")


def _check_moe_and_window(config: PretrainedConfig, arch: str):
    """Mistral/Mixtral attend within `sliding_window` tokens: we have no windowed attention, so a window
    shorter than the context is refused (Qwen configs clear sliding_window unless use_sliding_window).
    MoE sizes are checked before any expert is built."""
    window = getattr(config, "sliding_window", None)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and window is not None \
            and window < config.max_position_embeddings:
        raise ValueError(f"sliding-window attention is not supported: sliding_window={window} is shorter than "
                         f"max_position_embeddings={config.max_position_embeddings}")
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return
    sizes = {"num_experts_per_tok": config.num_experts_per_tok}
    if arch == "MixtralForCausalLM":
        sizes["num_local_experts"] = config.num_local_experts
    else:
        sizes.update(num_experts=config.num_experts, moe_intermediate_size=config.moe_intermediate_size,
                     decoder_sparse_step=config.decoder_sparse_step)
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model config: {name} must be a positive int, got {value!r}")
    experts = sizes.get("num_local_experts", sizes.get("num_experts"))
    if config.num_experts_per_tok > experts:
        raise ValueError(f"model config: num_experts_per_tok={config.num_experts_per_tok} exceeds the "
                         f"{experts} experts")
    only = getattr(config, "mlp_only_layers", None) or []
    if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"model config: mlp_only_layers must be a list of layer indices, got {only!r}")
    if config.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")


def get_model_class(config: PretrainedConfig):
    module, name = MODELS[check_architecture(config)]
    return getattr(importlib.import_module(module), name)
