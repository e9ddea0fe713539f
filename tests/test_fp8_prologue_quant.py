"""The fused RMSNorm / SiLU * mul + FP8 activation quantization kernel (kernels/fp8_prologue_quant.py;
interpreter on CPU, real on GPU) against the two steps it replaces: the step's torch reference
(layers/layernorm.py, SiLU * mul), then the activation quantization (torch on CPU, the quantization
kernel on GPU); and the FP8 linear layer taking a Deferred input at several rows."""
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels.fp8_prologue_quant import quantize_fp8_after
from nanoinfer.layers.layernorm import add_rms_norm, rms_norm
from nanoinfer.quant.fp8_math import quantize_activations

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference_step(x, kind, nw, res, eps=1e-6):
    """(the step's output, the new residual or None)"""
    if kind == "silu":
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up, None
    if res is None:
        return rms_norm(x, nw, eps), None
    return add_rms_norm(x, res, nw, eps)


def inputs(m, k, kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 2 * k if kind == "silu" else k, generator=g) * 2).to(DEV, dtype)
    nw = (torch.rand(k, generator=g) + 0.5).to(DEV, dtype)
    res = (torch.randn(m, k, generator=g)).to(DEV, dtype) if kind == "norm+res" else None
    return x, nw, res


def run(x, kind, nw, res, gk, **kw):
    res_out = torch.full_like(res, float("nan")) if res is not None else None
    q, s = quantize_fp8_after(x, norm_weight=None if kind == "silu" else nw, eps=1e-6, residual=res,
                              residual_out=res_out, silu_mul=kind == "silu", group_k=gk, **kw)
    return q, s, res_out


def assert_codes_agree(q, s, q_ref, s_ref, k_group):
    """The same scales and e4m3 codes, but for a rare value the norm's float32 summation order rounds
    to a neighbouring code."""
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    same = (q.float() == q_ref.float()).float().mean().item()
    assert same > 0.99, same
    deq = q.float() * s.repeat_interleave(k_group, 1)[:, :q.shape[1]]
    deq_ref = q_ref.float() * s_ref.repeat_interleave(k_group, 1)[:, :q.shape[1]]
    torch.testing.assert_close(deq, deq_ref, rtol=0.13, atol=1e-6)  # (one e4m3 step at most)


@pytest.mark.parametrize("kind", ["norm", "norm+res", "silu"])
@pytest.mark.parametrize("m,k,gk", [(3, 96, None), (4, 80, 32), (2, 64, 16)])
def test_matches_the_step_then_the_quantization(kind, m, k, gk):
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    x, nw, res = inputs(m, k, kind, dtype)
    q, s, res_out = run(x, kind, nw, res, gk, out_dtype=torch.float32)  # (the interpreter's FP8 cast is wrong)
    step, new_res = reference_step(x, kind, nw, res)
    q_ref, s_ref = quantize_activations(step, gk)
    assert_codes_agree(q, s, q_ref, s_ref, gk or k)
    if new_res is not None:
        assert torch.equal(res_out, new_res)


def test_rejects_bad_arguments():
    x, nw, res = inputs(2, 32, "norm+res", torch.float32)
    with pytest.raises(ValueError, match="either norm_weight or silu_mul"):
        quantize_fp8_after(x, norm_weight=nw, silu_mul=True)
    with pytest.raises(ValueError, match="residual_out"):
        quantize_fp8_after(x, norm_weight=nw, residual=res, residual_out=res)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["norm", "norm+res", "silu"])
@pytest.mark.parametrize("gk", [None, 128])
def test_cuda_matches_the_two_kernels(kind, gk):
    from nanoinfer.kernels.fp8_quant import quantize_fp8
    x, nw, res = inputs(37, 4096, kind, torch.bfloat16, seed=7)
    q, s, res_out = run(x, kind, nw, res, gk)
    step, new_res = reference_step(x, kind, nw, res)
    q_ref, s_ref = quantize_fp8(step.contiguous(), gk)
    assert_codes_agree(q, s, q_ref, s_ref, gk or 4096)
    if new_res is not None:
        assert torch.equal(res_out, new_res)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [2, 16, 64, 200])
def test_cuda_fp8_layer_takes_a_deferred_input(monkeypatch, m):
    """A dummy-weight FP8 layer at m rows: a Deferred RMSNorm (with residual) input gives what the
    materialised norm does, and writes the new residual. (The fused quantization is off by default
    and W8A16 takes the few rows: both switched here so that this W8A8 path runs at every m.)"""
    from nanoinfer.layers.linear import MergedColumnParallelLinear
    from nanoinfer.layers.linear_method import Deferred
    from nanoinfer.layers.model_build import ModelBuild
    from nanoinfer.quant import Fp8Scheme, fp8_linear, linear_method_chooser
    monkeypatch.setattr(fp8_linear, "FUSED_QUANT_MAX_ROWS", 256)
    monkeypatch.setattr(fp8_linear, "W8A16_MAX_ROWS", 0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = MergedColumnParallelLinear(1024, [512, 512], build=ModelBuild(
            linear_method=linear_method_chooser(Fp8Scheme("channel", online=True), {})), prefix="m.gate_up_proj")
    finally:
        torch.set_default_dtype(torch.float32)
    layer = layer.cuda()
    for shard in (0, 1):
        layer.weight_loader(layer.weight, torch.randn(512, 1024, dtype=torch.bfloat16) * 0.05, shard)
    layer.method.process_weights_after_loading(layer)
    x, nw, res = inputs(m, 1024, "norm+res", torch.bfloat16, seed=m)
    assert layer.takes_deferred(x)
    res_out = torch.empty_like(res)
    y = layer(Deferred(x, norm_weight=nw, eps=1e-6, residual=res, residual_out=res_out))
    normed, new_res = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(res_out, new_res)
    ref = layer(normed)
    assert (y.float() - ref.float()).norm() / ref.float().norm() < 1e-2


@pytest.mark.parametrize("kind", ["norm", "norm+res", "silu"])
def test_fp8_layer_routes_a_deferred_input_into_the_quantization_on_cpu(monkeypatch, kind):
    """Fp8LinearMethod's glue on CPU (weights kept FP8; the CUDA-only row check forced): a Deferred
    input at 2+ rows reaches quantize_fp8_after with its step (norm, residual, SiLU * mul) and the
    W8A8 product, and gives what the materialised step gives. (The interpreter's FP8 cast is
    wrong: both quantizations run as torch here, kernels/fp8_quant's and this file's kernel.)"""
    from nanoinfer.kernels import fp8_prologue_quant, fp8_quant
    from nanoinfer.layers.linear import MergedColumnParallelLinear
    from nanoinfer.layers.linear_method import Deferred
    from nanoinfer.layers.model_build import ModelBuild
    from nanoinfer.quant import Fp8Scheme, fp8_linear, linear_method_chooser
    calls = []

    def torch_after(x, *, norm_weight=None, eps=0.0, residual=None, residual_out=None, silu_mul=False, group_k=None):
        calls.append((silu_mul, residual is not None))
        step, new_res = reference_step(x, "silu" if silu_mul else "norm+res" if residual is not None else "norm",
                                       norm_weight, residual, eps)
        if residual_out is not None:
            residual_out.copy_(new_res)
        return quantize_activations(step, group_k)

    monkeypatch.setattr(fp8_linear, "keeps_fp8", lambda device: True)
    monkeypatch.setattr(fp8_linear, "takes_gemv", lambda x: x.shape[0] == 1)
    monkeypatch.setattr(fp8_linear, "scaled_mm_ok", lambda device, n, k: False)
    monkeypatch.setattr(fp8_linear.Fp8LinearMethod, "_quantizes_after", lambda self, layer, x: x.shape[0] >= 2)
    monkeypatch.setattr(fp8_linear, "W8A16_MAX_ROWS", 0)  # (W8A16 would take these few rows)
    monkeypatch.setattr(fp8_quant, "quantize_fp8", quantize_activations)
    monkeypatch.setattr(fp8_prologue_quant, "quantize_fp8_after", torch_after)
    k = 64
    layer = MergedColumnParallelLinear(k, [40, 40], build=ModelBuild(
        linear_method=linear_method_chooser(Fp8Scheme("channel", online=True), {})), prefix="m.gate_up_proj")
    g = torch.Generator().manual_seed(9)
    for shard in (0, 1):
        layer.weight_loader(layer.weight, torch.randn(40, k, generator=g) * 0.1, shard)
    layer.method.process_weights_after_loading(layer)
    x, nw, res = inputs(5, k, kind, torch.float32, seed=11)
    assert layer.takes_deferred(x)
    res_out = torch.full_like(res, float("nan")) if res is not None else None
    y = layer(Deferred(x, norm_weight=None if kind == "silu" else nw, eps=1e-6, residual=res, residual_out=res_out,
                       silu_mul=kind == "silu"))
    step, new_res = reference_step(x, kind, nw, res)
    assert calls == [(kind == "silu", kind == "norm+res")]
    torch.testing.assert_close(y, layer(step.contiguous()), rtol=0, atol=0)
    if new_res is not None:
        assert torch.equal(res_out, new_res)
