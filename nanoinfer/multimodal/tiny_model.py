"""Tiny random-weight Qwen2.5-VL (and Qwen3-VL) checkpoints (HF config, safetensors, the PIL image processor's
preprocessor_config.json, a locally trained tokenizer with the vision special tokens): the tests'
fixtures and bench.py's CPU check. Nothing is downloaded."""
import json
import os

import torch
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)

from nanoinfer.utils.tiny_model import train_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def vl_config(tokenizer, *, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
              vision_hidden=32, vision_heads=2, vision_depth=2, fullatt_block_indexes=(1,), window_size=56,
              mrope_section=(2, 3, 3), max_position_embeddings=4096, vocab_size=None):
    """A Qwen2_5_VLConfig whose special token ids are the tokenizer's."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": list(mrope_section), "rope_theta": 10000.0},
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    # (an intermediate size that is not a multiple of 8, as Qwen2.5-VL-7B's 3420: CUDA pads it)
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden + 6,
                  num_heads=vision_heads, out_hidden_size=hidden_size,
                  fullatt_block_indexes=list(fullatt_block_indexes),
                  window_size=window_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def qwen3_vl_config(tokenizer, *, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, vision_hidden=32, vision_heads=2, vision_depth=3,
                    deepstack_visual_indexes=(0, 1), num_position_embeddings=64, mrope_section=(4, 2, 2)):
    """A Qwen3VLConfig (interleaved M-RoPE, DeepStack) whose special token ids are the tokenizer's."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": list(mrope_section),
                                 "mrope_interleaved": True, "rope_theta": 10000.0},
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    # (an intermediate size that is not a multiple of 8, as Qwen2.5-VL-7B's 3420: CUDA pads it)
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden + 6,
                  num_heads=vision_heads, out_hidden_size=hidden_size, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=num_position_embeddings,
                  deepstack_visual_indexes=list(deepstack_visual_indexes), hidden_act="gelu_pytorch_tanh")
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def vl_tokenizer():
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tokenizer


def save_image_processor(path: str, min_pixels: int = 4 * 28 * 28, max_pixels: int = 64 * 28 * 28,
                         patch_size: int = 14):
    """The PIL Qwen2-VL image processor (no torchvision needed), its pixel bounds small for CPU tests."""
    try:  # (the class name depends on the transformers version)
        from transformers import Qwen2VLImageProcessorPil as processor_class
    except ImportError:  # transformers 4.x: the slow processor is the PIL one
        from transformers import Qwen2VLImageProcessor as processor_class
    processor_class(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size).save_pretrained(path)


def build_tiny_vl_checkpoint(path: str, seed: int = 0, arch: str = "qwen2_5_vl", **sizes) -> str:
    """Write a random Qwen2.5-VL (arch "qwen2_5_vl") or Qwen3-VL ("qwen3_vl") checkpoint (float32)
    with its image processor and tokenizer to `path`. `sizes`: vl_config's / qwen3_vl_config's keywords."""

    tokenizer = vl_tokenizer()
    if arch not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"arch must be 'qwen2_5_vl' or 'qwen3_vl', got {arch!r}")
    qwen3 = arch == "qwen3_vl"
    config = (qwen3_vl_config if qwen3 else vl_config)(tokenizer, **sizes)
    torch.manual_seed(seed)
    model = (Qwen3VLForConditionalGeneration if qwen3 else Qwen2_5_VLForConditionalGeneration)(config).float()
    with torch.no_grad():  # HF initialises biases and norms to constants; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name or name.endswith("ln_q.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if qwen3:  # 16-pixel patches: 32 x 32 pixels a token
        save_image_processor(path, min_pixels=4 * 32 * 32, max_pixels=64 * 32 * 32, patch_size=16)
    else:
        save_image_processor(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tokenizer.eos_token_id]}, f)
    return path
