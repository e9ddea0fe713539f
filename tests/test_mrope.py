"""M-RoPE positions (multimodal/mrope.py) against HF's Qwen2_5_VLModel.get_rope_index, and the
per-token rotary table against HF's rotary embedding."""
import itertools

import numpy as np
import pytest
import torch

from nanoinfer.multimodal.mrope import MRotaryEmbedding, mrope_positions


@pytest.mark.parametrize("layout", [
    [(5, (1, 4, 6))],
    [(0, (1, 8, 2)), (9, (1, 2, 2))],
    [(3, (1, 6, 6)), (20, (1, 4, 10)), (35, (1, 2, 4))],
    [],
])
def test_positions_match_hf(layout):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    images = []
    total = 50
    tokens = [0] * total
    for start, grid in layout:
        count = grid[0] * grid[1] * grid[2] // 4
        images.append((start, *grid))
        for i in range(start, start + count):
            tokens[i] = 1
    ours, delta = mrope_positions(total, images, 2)
    if not layout:
        assert (ours == np.arange(total)).all() and delta == 0
        return
    config = Qwen2_5_VLConfig(vision_config=dict(spatial_merge_size=2))
    ids = torch.tensor([tokens])
    theirs, their_delta = Qwen2_5_VLModel.get_rope_index(
        type("M", (), {"config": config, "get_vision_position_ids": Qwen2_5_VLModel.get_vision_position_ids})(),
        ids, mm_token_type_ids=ids.int(), image_grid_thw=torch.tensor([g for _, g in layout]))
    assert (theirs[:, 0].numpy() == ours).all()
    assert delta == int(their_delta)


def test_interleaved_sections():
    """Qwen3-VL: t, h, w, t, h, w, ... over the first 3 * sections, then temporal (as HF's
    Qwen3VLTextRotaryEmbedding recomposes them)."""
    from nanoinfer.multimodal.mrope import section_of_frequencies
    assert section_of_frequencies([4, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert section_of_frequencies([24, 20, 20], True).tolist()[57:64] == [0, 1, 2, 0, 0, 0, 0]
    assert section_of_frequencies([2, 3, 3], False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_per_token_table_matches_sections():
    rotary = MRotaryEmbedding(16, 64, 10000.0, [2, 3, 3])
    positions = torch.tensor([[0, 3, 5], [1, 4, 9], [2, 7, 11]])
    table = rotary.table(positions)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    for n, j in itertools.product(range(3), range(8)):
        section = 0 if j < 2 else 1 if j < 5 else 2
        angle = positions[section, n] * inv[j]
        assert torch.allclose(table[n, j], angle.cos()) and torch.allclose(table[n, 8 + j], angle.sin())
    with rotary.per_token(positions) as flat:
        assert flat.tolist() == [0, 1, 2] and rotary.cos_sin_cache.shape == (3, 16)
    assert rotary.cos_sin_cache is rotary.base_cache
