"""models/qwen2_5_vision.py's pieces on their own: the MLP's zero padding of its intermediate
features (what CUDA does to Qwen2.5-VL-7B's 3420) leaves its output unchanged."""
import torch

from nanoinfer.layers.model_build import ModelBuild, TensorParallel
from nanoinfer.models.qwen2_5_vision import VisionMLP


def test_padding_the_intermediate_features_changes_nothing():
    torch.manual_seed(0)
    mlp = VisionMLP(32, 70, ModelBuild(TensorParallel(0, 1)), "mlp")
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(9, 32)
    want = mlp(x)
    mlp.pad_intermediate(64)
    assert mlp.gate_up_proj.weight.shape == (256, 32) and mlp.down_proj.weight.shape == (32, 128)
    assert mlp.gate_up_proj.bias.shape == (256,)
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    mlp.pad_intermediate(64)  # already a multiple: nothing to do
    assert mlp.down_proj.weight.shape == (32, 128)
