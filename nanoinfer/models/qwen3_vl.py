"""Qwen3-VL (dense): the vision tower of models/qwen3_vl_vision.py and a Qwen3 decoder (q/k norm)
with interleaved M-RoPE; DeepStack: the tower's intermediate features are added to the residual
stream of the first decoder layers at the image tokens. Checkpoint names: `model.visual.*`,
`model.language_model.*`, `lm_head` (the Hub's and transformers' layout); `visual.*` / `model.*` too.

The image rows of a step come in its context (`mm_embeds`: rows and [rows, 1 + DeepStack, hidden]),
as for Qwen2.5-VL (models/qwen2_5_vl.py)."""
import torch
from transformers import PretrainedConfig

from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.models.qwen3 import Qwen3ForCausalLM
from nanoinfer.models.qwen2_5_vision import dummy_images
from nanoinfer.models.qwen3_vl_vision import Qwen3VLVisionTransformer
from nanoinfer.models.vl_rope import mrope_for
from nanoinfer.multimodal.mrope import MRotaryEmbedding
from nanoinfer.utils.context import get_context


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}

    def __init__(self, config: PretrainedConfig, build: ModelBuild):
        super().__init__(config, build)
        self.visual = Qwen3VLVisionTransformer(config.vision_config, build.unsharded())
        self.vision_config = config.vision_config

    def make_rotary(self, config: PretrainedConfig, build: ModelBuild) -> MRotaryEmbedding:
        self.rotary = mrope_for(config, build, "Qwen3-VL", interleaved_default=True)
        return self.rotary

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Every image's [its tokens, 1 + DeepStack layers, hidden]."""
        merge = self.visual.merge ** 2
        return list(self.visual(pixels, grids).split([t * h * w // merge for t, h, w in grids]))

    @torch.inference_mode()
    def profile_encoder(self, num_tokens: int):
        """Run the tower on images making num_tokens tokens (the engine's memory profiling)."""
        weight = self.lm_head.weight
        self.encode_images(*dummy_images(self.vision_config, num_tokens, weight.device, weight.dtype))

    def forward(self, input_ids, positions):
        mm = get_context().mm_embeds
        embeds = hook = None
        if mm is not None:
            rows, values = mm
            values = values.to(self.lm_head.weight.dtype)
            embeds = self.model.embed_tokens(input_ids).index_copy(0, rows, values[:, 0])
            deepstack = values.shape[1] - 1

            def add_deepstack(i, hidden, residual):  # (the residual is the stream's full tensor on every rank)
                if i < deepstack:
                    residual = residual.index_add(0, rows, values[:, 1 + i])
                return hidden, residual
            hook = add_deepstack
        if positions.dim() == 2:
            with self.rotary.per_token(positions) as flat:
                return self.model(input_ids, flat, embeds, hook)
        return self.model(input_ids, positions, embeds, hook)
