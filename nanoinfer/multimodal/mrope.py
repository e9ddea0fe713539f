"""M-RoPE (Qwen2-VL / Qwen2.5-VL): every token has three positions (temporal, height, width), and the
rotary frequencies are split in three sections (`mrope_section`), each rotated by one of them.

A text token's three positions are equal, and after an image the text continues from the image's
largest position + 1, so past the prompt a token's position is its index plus the request's
`rope_delta` (<= 0). Only image tokens need three distinct positions: a step whose rows cover none
sends one position per token, which the ordinary cos/sin cache serves (CUDA-graph decode included);
a step with image tokens sends [3, N] positions, and the model rotates with a per-token table built
from them (`MRotaryEmbedding.per_token`)."""
from contextlib import contextmanager

import numpy as np
import torch

from nanoinfer.layers.rotary_embedding import RotaryEmbedding


def mrope_positions(num_tokens: int, images: list[tuple[int, int, int, int]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """The [3, num_tokens] positions of a prompt and its rope delta. images: (offset, t, h, w) of each
    image's tokens in the prompt (grid sizes in patches, before merging), in prompt order. As HF's
    Qwen2_5_VLModel.get_rope_index for still images."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = 0   # the next text token's position
    index = 0    # the next token's index in the prompt
    for offset, t, h, w in images:
        positions[:, index:offset] = np.arange(cursor, cursor + offset - index)
        cursor += offset - index
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[:, offset:offset + count] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cursor
        cursor += max(gh, gw)  # (a still image: t = 1 adds nothing)
        index = offset + count
    positions[:, index:] = np.arange(cursor, cursor + num_tokens - index)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def section_of_frequencies(mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """Which position component (0: temporal, 1: height, 2: width) turns each rotary frequency:
    contiguous sections (Qwen2-VL, Qwen2.5-VL), or interleaved t, h, w, t, h, w, ... with the rest
    temporal (Qwen3-VL: frequency j is h's when j % 3 == 1 and j < 3 * sections[1], w's likewise)."""
    half = sum(mrope_section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
    out = torch.zeros(half, dtype=torch.long)
    for component in (1, 2):
        out[component:3 * mrope_section[component]:3] = component
    return out


class MRotaryEmbedding(RotaryEmbedding):
    """The neox-style rotary of layers/rotary_embedding.py, whose frequency j turns with position
    component `section_of[j]` (section_of_frequencies)."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: list[int],
                 interleaved: bool = False):
        super().__init__(head_dim, max_position, base)
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(f"model config: mrope_section {mrope_section} must be 3 sections summing to "
                             f"head_dim / 2 = {head_dim // 2}")
        section_of = section_of_frequencies(list(mrope_section), interleaved)
        self.register_buffer("section_of", section_of, persistent=False)
        self.base_cache = self.cos_sin_cache

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """[3, N] positions -> the per-token cos/sin rows [N, head_dim]."""
        half = self.section_of.shape[0]
        cols = torch.arange(half, device=positions.device)
        rows = positions[self.section_of].T  # [N, half]: the position each frequency turns with
        cos = self.base_cache[rows, cols]
        sin = self.base_cache[rows, cols + half]
        return torch.cat([cos, sin], dim=-1).contiguous()

    @contextmanager
    def per_token(self, positions: torch.Tensor):
        """While inside, every attention layer rotates token i with row i of the table built from
        `positions` [3, N]: the layers read `cos_sin_cache` at `arange(N)`, which this yields."""
        self.cos_sin_cache = self.table(positions)
        try:
            yield torch.arange(positions.shape[1], device=positions.device)
        finally:
            self.cos_sin_cache = self.base_cache
