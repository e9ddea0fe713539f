"""HF `architectures` name -> our model class."""
from transformers import PretrainedConfig

MODELS = {
    "Qwen3ForCausalLM": ("nanoinfer.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("nanoinfer.models.qwen3", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("nanoinfer.models.llama", "LlamaForCausalLM"),
}


def check_architecture(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            _check_supported_options(config)
            return arch
    raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
                     f"supported: {', '.join(sorted(MODELS))}")


def _check_supported_options(config: PretrainedConfig):
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: 'default' and 'llama3' RoPE are implemented")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")


def get_model_class(config: PretrainedConfig):
    import importlib
    module, name = MODELS[check_architecture(config)]
    return getattr(importlib.import_module(module), name)
