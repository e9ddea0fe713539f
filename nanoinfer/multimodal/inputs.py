"""What a request's images become at intake, and ride on its Sequence: each image's place in the
prompt, its patches and grid, its content hash; the prompt's M-RoPE positions and rope delta."""
from dataclasses import dataclass

import numpy as np

PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs")


@dataclass(frozen=True, slots=True)
class ImageItem:
    offset: int               # its first token's index in the prompt
    num_tokens: int           # language-model tokens (patches / merge^2)
    key: int                  # the encoder cache's and prefix cache's key (processor.image_key)
    pixel_values: np.ndarray  # [patches, C * T * P * P] float32, as the image processor made them
    grid_thw: tuple[int, int, int]

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True, slots=True)
class MultiModalInputs:
    images: tuple[ImageItem, ...]   # in prompt order
    positions: np.ndarray           # [3, prompt tokens] M-RoPE positions
    rope_delta: int                 # a token past the prompt at index i has position i + rope_delta

    def block_keys(self, block: int, block_size: int) -> tuple[int, ...]:
        """The keys of the images whose tokens block `block` covers (they change its K/V)."""
        lo, hi = block * block_size, (block + 1) * block_size
        return tuple(im.key for im in self.images if im.offset < hi and im.end > lo)

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] positions of tokens start..end-1 (past the prompt: index + rope_delta)."""
        prompt = self.positions.shape[1]
        if end <= prompt:
            return self.positions[:, start:end]
        tail = np.arange(max(start, prompt), end) + self.rope_delta
        head = self.positions[:, start:prompt] if start < prompt else np.empty((3, 0), dtype=np.int64)
        return np.concatenate([head, np.broadcast_to(tail, (3, tail.shape[0]))], axis=1)

    def text_positions(self, start: int, end: int) -> list[int]:
        """The positions of tokens start..end-1, which cover no image token (their three agree)."""
        prompt = self.positions.shape[1]
        head = self.positions[0, start:min(end, prompt)].tolist() if start < prompt else []
        return head + list(range(max(start, prompt) + self.rope_delta, end + self.rope_delta))

    def covers_image(self, start: int, end: int) -> bool:
        return any(im.offset < end and im.end > start for im in self.images)


def split_multi_modal(prompt) -> tuple[object, dict | None, dict | None]:
    """A prompt dict's text/token part, and its multi_modal_data and mm_processor_kwargs (None when
    absent); any other prompt is returned as is."""
    if not isinstance(prompt, dict) or not any(k in prompt for k in PROMPT_KEYS):
        return prompt, None, None
    rest = {k: v for k, v in prompt.items() if k not in PROMPT_KEYS}
    data, kwargs = prompt.get("multi_modal_data"), prompt.get("mm_processor_kwargs")
    if data is not None and not isinstance(data, dict):
        raise TypeError("multi_modal_data must be a dict like {'image': image or [images]}, "
                        f"got {type(data).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"mm_processor_kwargs must be a dict, got {type(kwargs).__name__}")
    return rest, data, kwargs
