"""A vision-language checkpoint's config, as the engine reads it.

The core reads a text model's sizes off `Config.hf_config` (vocab_size, hidden_size, heads, ...). A
vision-language config nests them under `text_config`, so the engine gets that text config, which
also carries what the model and the intake need from the composite one: `architectures`,
`vision_config`, the image token ids and `tie_word_embeddings`."""
import copy

from transformers import PretrainedConfig

_CARRIED = ("architectures", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id", "tie_word_embeddings")


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
    return text
