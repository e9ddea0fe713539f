"""Images' engine hooks (step/feature.py): at intake, a prompt's image placeholders expand before
its length is checked, and its images are preprocessed in an intake thread (processor.py); each
step's message gets its rows' rotary positions and the images to encode (step_planner.py). A model
that takes no images refuses a prompt that brings some."""
import numpy as np

from nanoinfer.step.feature import EngineFeature, Intake, RankFeature
from nanoinfer.multimodal.encoder_cache import EncoderCache
from nanoinfer.multimodal.inputs import PROMPT_KEYS, split_multi_modal
from nanoinfer.multimodal.processor import MultiModalProcessor
from nanoinfer.multimodal.step_planner import IMAGES, ROPE_POSITIONS, MultiModalStepPlanner


class ImageFeature(EngineFeature):
    prompt_keys = PROMPT_KEYS

    def __init__(self, config, vocab_size: int):
        self.processor = None  # a vision-language model's image intake
        if getattr(config.hf_config, "vision_config", None) is not None:
            self.processor = MultiModalProcessor(config.model, config.hf_config, vocab_size,
                                                 config.limit_mm_per_prompt, config.max_image_pixels)
        self.planner = MultiModalStepPlanner()  # requests with images: their rows' positions and images

    def check_request(self, intake: Intake) -> None:
        _, data, kwargs = split_multi_modal(intake.extras)
        images = None  # the work that makes the prompt's MultiModalInputs
        if self.processor is not None:  # images expand their placeholders before any length check
            intake.token_ids, images = self.processor.process(intake.token_ids, data, kwargs)
        elif data or kwargs:
            raise ValueError("multi_modal_data / mm_processor_kwargs given, but this model takes no images")
        intake.extras["images"] = images

    def prepare(self, intake: Intake) -> None:
        images = intake.extras["images"]
        if images is None:
            return
        if intake.truncated:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        seqs = intake.seqs
        intake.work.append(lambda: _set_multi_modal(seqs, images()))

    def encode(self, batch, step, sample, sampling_seqs):
        rope, images = self.planner.plan(batch)
        if rope is not None:
            step.add_part(ROPE_POSITIONS, rope)
        if images is not None:
            step.add_part(IMAGES, images)
        step.prefill = step.prefill or rope is not None or images is not None  # (never a step of short rows)

    def unschedule(self) -> None:
        self.planner.unschedule()


def _set_multi_modal(seqs: list, mm) -> None:
    for seq in seqs:
        seq.multi_modal = mm


class ImageRankFeature(RankFeature):
    """A rank's encoded images (a vision-language model's): a step's image embeddings reach the
    model through the forward context, its M-RoPE positions replace the plain ones."""
    warms_up = False  # (the warm-up makes no step with images)

    def __init__(self, runner):
        self.cache = EncoderCache(runner.model, runner.device)

    def before_forward(self, step) -> dict | None:
        fields = {}
        rope, images = step.part(ROPE_POSITIONS), step.part(IMAGES)
        if rope is not None:  # [positions] (flat), or [t, h, w] in a step with image tokens
            fields["positions"] = rope[0] if len(rope) == 1 else np.asarray(rope, dtype=np.int64)
        if images is not None:
            fields["mm_embeds"] = self.cache.step_embeds(images)
        return fields or None

    def exit(self) -> None:
        self.cache.embeddings.clear()
        self.cache.model = None
