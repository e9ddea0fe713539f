"""Issue 27 (findings 5-7): non-finite weights, integer/bool tensors, bad eps/theta and absurd sizes are
refused with a ValueError naming the tensor or field; one RoPE cache, sized by max_model_len, is shared."""
import pytest
import torch
from transformers import AutoConfig

from nanoinfer.config import Config
from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.models import get_model_class
from test_loading import LAYER, copy_checkpoint, load


def _set(name, fn):
    def edit(tensors):
        tensors[name] = fn(tensors[name])
    return edit


def _nan(t):
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t.view(-1)[0] = float("inf")
    return t


@pytest.mark.parametrize("name, fn, match", [
    (f"{LAYER}mlp.down_proj.weight", _nan, "NaN or inf"),
    ("model.norm.weight", _inf, "NaN or inf"),
    (f"{LAYER}self_attn.k_proj.weight", _nan, "NaN or inf"),     # one shard of the fused QKV
    (f"{LAYER}mlp.up_proj.weight", lambda t: t.to(torch.int32), "torch.int32"),
    ("model.norm.weight", lambda t: t.bool(), "torch.bool"),
])
def test_bad_tensor_is_named(tiny_qwen3, tmp_path, name, fn, match):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", _set(name, fn))
    with pytest.raises(ValueError, match=match) as err:
        load(path)
    assert name in str(err.value)


def test_float_to_float_dtype_still_loads(tiny_qwen3, tmp_path):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    load(path)


@pytest.mark.parametrize("edit, match", [
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a finite number > 0"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
    (dict(rope_theta=float("inf")), "rope_theta"),
    (dict(hidden_size=10**9), r"hidden_size must be in \[1, 131072\]"),
    (dict(vocab_size=10**12), r"vocab_size must be in \[1, 16777216\]"),
])
def test_bad_config_numbers_are_refused(tiny_qwen3, tmp_path, edit, match):
    def apply(c):
        c.update(edit)
        if "rope_theta" in edit and isinstance(c.get("rope_parameters"), dict):
            c["rope_parameters"]["rope_theta"] = edit["rope_theta"]
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", edit_config=apply)
    with pytest.raises(ValueError, match=match):
        Config.from_options(str(path))


def test_weights_beyond_memory_are_refused_before_allocating(tiny_qwen3, tmp_path):
    from nanoinfer.models.build import build_model
    from nanoinfer.layers.attention_backend import TorchAttentionBackend
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", edit_config=lambda c: c.update(
        vocab_size=1 << 24, hidden_size=1 << 17, intermediate_size=1 << 10, head_dim=16))
    config = Config.from_options(str(path), load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="weights take about .* GiB"):
        build_model(config, 0, 1, torch.device("cpu"), TorchAttentionBackend())


def test_one_rope_cache_sized_by_max_model_len(tiny_qwen3):
    hf = AutoConfig.from_pretrained(tiny_qwen3)
    model = get_model_class(hf)(hf, ModelBuild(max_model_len=256))
    caches = {id(layer.self_attn.attn.rotary_emb.cos_sin_cache) for layer in model.model.layers}
    assert len(caches) == 1
    cache = model.model.layers[0].self_attn.attn.rotary_emb.cos_sin_cache
    assert cache.shape == (256, 16)
    full = get_model_class(hf)(hf, ModelBuild()).model.layers[0].self_attn.attn.rotary_emb.cos_sin_cache
    assert full.shape[0] == hf.max_position_embeddings and torch.equal(full[:256], cache)
