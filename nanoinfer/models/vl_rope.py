"""The M-RoPE a vision-language model's config asks for (Qwen2.5-VL, Qwen3-VL)."""
from nanoinfer.models.config_limits import head_dim, rope_theta
from nanoinfer.multimodal.mrope import MRotaryEmbedding


def mrope_for(config, build, model_name: str, interleaved_default: bool | None = None) -> MRotaryEmbedding:
    """The M-RoPE of a vision-language config: its rope_parameters' (or rope_scaling's)
    mrope_section, and mrope_interleaved (Qwen3-VL) where `interleaved_default` is given."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    section = params.get("mrope_section")
    if section is None:
        raise ValueError(f"model config: rope_parameters.mrope_section is missing ({model_name}'s M-RoPE sections)")
    interleaved = interleaved_default is not None and bool(params.get("mrope_interleaved", interleaved_default))
    return MRotaryEmbedding(head_dim(config), build.rope_positions(config.max_position_embeddings),
                            rope_theta(config), list(section), interleaved)
