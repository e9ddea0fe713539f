"""What a model is built with (layers/model_build.py): tensor-parallel rank and size come from the
build, never from torch.distributed; `build_model` builds and loads one rank's model; and the weight
method seam (layers/linear_method.py) takes a format with parameters of its own, chosen per layer by
module name, without any change to the layers: here a per-output-channel scale, loaded through the
layers' tensor-parallel cut like a real quantized format's scales."""
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from nanoinfer.config import Config
from nanoinfer.layers.attention_backend import TorchAttentionBackend
from nanoinfer.layers.linear import QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.linear_method import DenseLinearMethod, linear, linear_parameter
from nanoinfer.layers.model_build import ModelBuild, TensorParallel
from nanoinfer.models import get_model_class
from nanoinfer.models.build import build_model
from nanoinfer.utils.loader import load_model


class ChannelScaledMethod(DenseLinearMethod):
    """y = (x @ W^T) * weight_scale, weight_scale [out_features] cut like the weight's rows. It
    applies its own product, so it takes no Deferred input."""

    def takes_deferred(self, layer, x):
        return False

    def create_weights(self, layer, input_size, output_size, bias):
        super().create_weights(layer, input_size, output_size, bias)
        layer.weight_scale = linear_parameter(torch.empty(output_size), 0, None)

    def apply(self, layer, x, bias=None, out=None):
        y = linear(x, layer.weight) * layer.weight_scale
        if out is not None:
            return out.copy_(y)
        return y if bias is None else y + bias


SCALED = ChannelScaledMethod()


def scaled_except(skipped: list[str]):
    """The build's choice: q/k/v projections scaled, except in the modules listed (as a quantized
    checkpoint lists the layers it leaves alone)."""
    def choose(prefix: str):
        return SCALED if prefix.endswith("qkv_proj") and not any(prefix.startswith(s) for s in skipped) \
            else DenseLinearMethod()
    return choose


def test_layers_never_ask_torch_distributed(monkeypatch, tiny_qwen3):
    """A tp=1 engine in a process where the user initialised torch.distributed must not shard."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 1)
    hf = AutoConfig.from_pretrained(tiny_qwen3)
    model = get_model_class(hf)(hf, ModelBuild())
    full = load_file(f"{tiny_qwen3}/model.safetensors")
    assert model.model.layers[0].mlp.down_proj.weight.shape == full["model.layers.0.mlp.down_proj.weight"].shape
    assert model.model.embed_tokens.weight.shape == full["model.embed_tokens.weight"].shape
    load_model(model, tiny_qwen3)


def test_build_model_builds_one_rank_and_loads_it(tiny_qwen3):
    config = Config.from_options(tiny_qwen3)
    model = build_model(config, 1, 2, torch.device("cpu"), TorchAttentionBackend())
    attn = model.model.layers[0].self_attn
    assert attn.attn.backend.name == "torch" and attn.qkv_proj.tp == TensorParallel(1, 2)
    full = load_file(f"{tiny_qwen3}/model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, full[:, full.shape[1] // 2:])
    dummy = build_model(Config.from_options(tiny_qwen3, load_format="dummy"), 0, 1, torch.device("cpu"),
                        TorchAttentionBackend())
    again = build_model(Config.from_options(tiny_qwen3, load_format="dummy"), 0, 1, torch.device("cpu"),
                        TorchAttentionBackend())
    assert all(torch.equal(a, b) for a, b in zip(dummy.parameters(), again.parameters()))


def test_a_weight_method_with_its_own_parameters_loads_through_the_tp_cut():
    """Rank 1 of 2; 4 query heads, 1 KV head (replicated), head_dim 2: the scales' shards land where
    the weight's rows do."""
    build = ModelBuild(TensorParallel(1, 2), linear_method=lambda prefix: SCALED)
    qkv = QKVParallelLinear(6, 2, 4, 1, build=build, prefix="qkv_proj")
    scale = qkv.weight_scale
    assert scale.shard_ids == ("q", "k", "v") and not qkv.takes_deferred(torch.ones(1, 6))
    full = {"q": torch.arange(8.0), "k": torch.tensor([10.0, 11.0]), "v": torch.tensor([20.0, 21.0])}
    for shard, t in full.items():
        scale.weight_loader(scale, t, shard)
    assert scale.tolist() == [4.0, 5.0, 6.0, 7.0, 10.0, 11.0, 20.0, 21.0]
    with pytest.raises(ValueError, match=r"expected shape \[8\].*found \[4\]"):
        scale.weight_loader(scale, torch.ones(4), "q")
    down = RowParallelLinear(4, 6, build=build, prefix="o_proj")
    down.weight_scale.weight_loader(down.weight_scale, torch.arange(6.0))  # output features: not split
    assert down.weight_scale.tolist() == list(range(6))


def scaled_checkpoint(src, dst, skipped):
    """`src` with a weight_scale for every q/k/v projection outside `skipped`: 1 for q, 2 for k and v."""
    import shutil
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        if not any(name.startswith(s) for s in skipped):
            tensors[name.replace(".weight", ".weight_scale")] = torch.full((tensors[name].shape[0],),
                                                                           1.0 if "q_proj" in name else 2.0)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_a_weight_method_chosen_by_module_name_plugs_into_a_model(tiny_qwen3, tmp_path):
    skipped = ["model.layers.1."]
    hf = AutoConfig.from_pretrained(tiny_qwen3)
    model = get_model_class(hf)(hf, ModelBuild(linear_method=scaled_except(skipped)))
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.method is SCALED and layers[1].self_attn.qkv_proj.method is not SCALED
    assert isinstance(layers[0].self_attn.o_proj.method, DenseLinearMethod)
    path = scaled_checkpoint(tiny_qwen3, tmp_path / "scaled", skipped)
    load_model(model, str(path))
    assert layers[0].self_attn.qkv_proj.weight_scale[-1] == 2.0

    dense = get_model_class(hf)(hf, ModelBuild())
    load_model(dense, tiny_qwen3)
    qkv = torch.randn(5, 64)
    assert torch.equal(layers[0].self_attn.qkv_proj(qkv), dense.model.layers[0].self_attn.qkv_proj(qkv)
                       * layers[0].self_attn.qkv_proj.weight_scale)

    with pytest.raises(ValueError, match=r"lacks.*model\.layers\.0\.self_attn\.k_proj\.weight_scale"):
        load_model(get_model_class(hf)(hf, ModelBuild(linear_method=scaled_except(skipped))),
                   str(scaled_checkpoint(tiny_qwen3, tmp_path / "k-missing", skipped + ["model.layers.0.self_attn.k"])))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.[qkv]_proj\.weight_scale.*no matching parameter"):
        load_model(get_model_class(hf)(hf, ModelBuild(linear_method=scaled_except(skipped))),
                   str(scaled_checkpoint(tiny_qwen3, tmp_path / "unexpected", [])))
