"""A vision-language checkpoint's config, as the engine reads it.

The core reads a text model's sizes off `Config.hf_config` (vocab_size, hidden_size, heads, ...). A
vision-language config nests them under `text_config`, so the engine gets that text config, which
also carries what the model and the intake need from the composite one: `architectures`,
`vision_config`, the image token ids, `tie_word_embeddings`, `quantization_config` (and the
checkpoint's dtype when the text config has none)."""
import copy

from transformers import PretrainedConfig

_CARRIED = ("architectures", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id", "tie_word_embeddings", "quantization_config")


def is_multimodal(hf_config: PretrainedConfig) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def language_model_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The config the engine reads: `hf_config` itself for a text model; for a vision-language one
    whose sizes are nested in `text_config`, a copy of that text config carrying `_CARRIED`."""
    text = getattr(hf_config, "text_config", None)
    if not is_multimodal(hf_config) or text is None or text is hf_config:
        return hf_config
    text = copy.deepcopy(text)
    for name in _CARRIED:
        if getattr(hf_config, name, None) is not None:
            setattr(text, name, getattr(hf_config, name))
    if getattr(text, "dtype", None) is None and getattr(hf_config, "dtype", None) is not None:
        text.dtype = hf_config.dtype
    return text


def check_vision_config(config: PretrainedConfig):
    """The vision tower's sizes and the image token ids, before any layer is built from them."""
    vision = config.vision_config
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                 "spatial_merge_size", "temporal_patch_size", "in_channels"):
        value = getattr(vision, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model config: vision_config.{name} must be a positive int, got {value!r}")
    if vision.hidden_size % vision.num_heads or (vision.hidden_size // vision.num_heads) % 4:
        raise ValueError(f"model config: vision_config.hidden_size={vision.hidden_size} must split into "
                         f"num_heads={vision.num_heads} heads of a multiple of 4 (2D rotary)")
    if vision.out_hidden_size != config.hidden_size:
        raise ValueError(f"model config: vision_config.out_hidden_size={vision.out_hidden_size} must equal the "
                         f"language model's hidden_size={config.hidden_size}")
    for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or not 0 <= value < config.vocab_size:
            raise ValueError(f"model config: {name} must be a token id in [0, {config.vocab_size}), got {value!r}")
