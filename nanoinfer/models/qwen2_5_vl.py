"""Qwen2.5-VL: the vision tower (models/qwen2_5_vision.py) and a Qwen2 decoder with M-RoPE
(multimodal/mrope.py). Checkpoint names: `visual.*` for the tower, `model.*` and `lm_head` for the
language model (the names HF's Qwen2_5_VLForConditionalGeneration saves); the older
`model.language_model.*` / `model.visual.*` layout is read too.

The model's forward takes the same (input_ids, positions) as every model: positions are [N], or
[3, N] in a step whose rows cover image tokens; the image embeddings of such a step come in the step's
context (`mm_embeds`, set by the model runner from the encoder cache, multimodal/encoder_cache.py)."""
import torch
from transformers import PretrainedConfig

from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.models.qwen2_5_vision import Qwen2_5_VisionTransformer, dummy_images
from nanoinfer.models.qwen3 import Qwen2ForCausalLM
from nanoinfer.models.vl_rope import mrope_for
from nanoinfer.multimodal.mrope import MRotaryEmbedding
from nanoinfer.utils.context import get_context


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}

    def __init__(self, config: PretrainedConfig, build: ModelBuild):
        super().__init__(config, build)
        # replicated on every rank, dense whatever the language model's quantization
        self.visual = Qwen2_5_VisionTransformer(config.vision_config, build.unsharded())
        self.vision_config = config.vision_config

    def make_rotary(self, config: PretrainedConfig, build: ModelBuild) -> MRotaryEmbedding:
        self.rotary = mrope_for(config, build, "Qwen2.5-VL")
        return self.rotary

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Every image's embeddings [its tokens, hidden] (one tower call for them all)."""
        merge = self.visual.merge ** 2
        out = self.visual(pixels, grids)
        return list(out.split([t * h * w // merge for t, h, w in grids]))

    @torch.inference_mode()
    def profile_encoder(self, num_tokens: int):
        """Run the tower on images making num_tokens tokens (the engine's memory profiling)."""
        weight = self.lm_head.weight
        self.encode_images(*dummy_images(self.vision_config, num_tokens, weight.device, weight.dtype))

    def forward(self, input_ids, positions):
        mm = get_context().mm_embeds
        embeds = None
        if mm is not None:
            rows, values = mm
            embeds = self.model.embed_tokens(input_ids).index_copy(0, rows, values.to(self.lm_head.weight.dtype))
        if positions.dim() == 2:
            with self.rotary.per_token(positions) as flat:
                return self.model(input_ids, flat, embeds)
        return self.model(input_ids, positions, embeds)
