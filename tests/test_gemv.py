"""The one-row GEMV kernel (kernels/gemv.py), plain and with its RMSNorm / SiLU*mul prologues,
against the torch path it replaces: under TRITON_INTERPRET=1 on CPU (float32, float16), and on a
GPU (bfloat16, float32) at the 0.6B shapes too."""
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels.gemv import gemv
from nanoinfer.layers.activation import silu_and_mul
from nanoinfer.layers.layernorm import add_rms_norm, rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(40, 96), (7, 1000), (130, 64), (12, 2500)]  # (N, K): tails in both dimensions, several K tiles
if DEV == "cuda":
    SHAPES += [(4096, 1024), (1024, 2048), (1024, 3072)]


def dtypes():
    return [torch.bfloat16, torch.float32] if DEV == "cuda" else [torch.float32, torch.float16]


def assert_close(out, ref, dtype):
    """Equal up to summation order, plus one rounding of the output in 16 bits."""
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


def tensors(n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)  # noqa: E731
    return make(1, k, scale=3), make(n, k, scale=k ** -0.5), make(n), make(1, k), (torch.rand(k, generator=g) + 0.5).to(DEV, dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", dtypes())
def test_plain_and_bias(n, k, dtype):
    x, w, b, _, _ = tensors(n, k, dtype, n + k)
    assert_close(gemv(x, w), F.linear(x.float(), w.float()), dtype)
    assert_close(gemv(x, w, b), F.linear(x.float(), w.float(), b.float()), dtype)
    out = torch.empty(1, n, dtype=dtype, device=DEV)
    assert gemv(x, w, out=out) is out  # (tensor parallel: straight into the all-reduce's buffer)
    assert_close(out, F.linear(x.float(), w.float()), dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", dtypes())
def test_rms_norm_prologue(n, k, dtype):
    """y = add_rms_norm(x, residual) @ W^T, and the new residual stored exactly as torch rounds it."""
    x, w, _, res, nw = tensors(n, k, dtype, 2 * n + k)
    out = torch.empty_like(res)
    y = gemv(x, w, norm_weight=nw, eps=1e-6, residual=res, residual_out=out)
    normed, ref_res = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(out, ref_res)
    assert_close(y, F.linear(normed.float(), w.float()), dtype)
    assert_close(gemv(x, w, norm_weight=nw, eps=1e-6), F.linear(rms_norm(x, nw, 1e-6).float(), w.float()), dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", dtypes())
def test_silu_mul_prologue(n, k, dtype):
    g = torch.Generator().manual_seed(n * k)
    gate_up = (torch.randn(1, 2 * k, generator=g) * 4).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    assert_close(gemv(gate_up, w, silu_mul=True), F.linear(silu_and_mul(gate_up).float(), w.float()), dtype)


def test_bad_shapes_are_refused():
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv(torch.zeros(2, 16, device=DEV), w)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv(torch.zeros(1, 16, device=DEV), w, silu_mul=True)
    x, nw, res = torch.zeros(1, 16, device=DEV), torch.ones(16, device=DEV), torch.zeros(1, 16, device=DEV)
    with pytest.raises(ValueError, match="residual_out"):
        gemv(x, w, norm_weight=nw, residual=res)
    with pytest.raises(ValueError, match="must not share memory"):
        gemv(x, w, norm_weight=nw, residual=res, residual_out=res)
    with pytest.raises(ValueError, match="norm_weight must be"):
        gemv(x, w, norm_weight=torch.ones(8, device=DEV))


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on a CPU-only host; on a GPU the "
                    "one-row path runs for real (tests/test_gpu.py)")
@pytest.mark.parametrize("arch", ["qwen3-bias", "llama-mlp-bias", "qwen3-moe-dense-and-sparse"])
def test_one_row_steps_through_the_gemv_match_hf(make_checkpoint, tmp_path, monkeypatch, arch):
    """The engine's one-row path (every projection and the LM head through the GEMV, the norms and
    SiLU*mul deferred into it) end to end against HF, here on CPU under the interpreter: the rule
    that routes one-row CUDA inputs to the GEMV is widened to CPU inputs."""
    from hf_reference import assert_greedy_matches_hf
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.layers import linear_method
    from nanoinfer.utils.tiny_moe import build_tiny_moe_checkpoint
    if arch == "qwen3-moe-dense-and-sparse":
        path = build_tiny_moe_checkpoint(str(tmp_path), num_layers=2, mlp_only_layers=(0,))
    else:
        path = make_checkpoint(arch=arch.split("-")[0], attention_bias=True, mlp_bias=arch.startswith("llama"))
    calls = []

    def counted_gemv(*args, **kwargs):
        calls.append(kwargs.get("norm_weight") is not None or kwargs.get("silu_mul", False))
        return gemv(*args, **kwargs)

    monkeypatch.setattr(linear_method, "takes_gemv", lambda x: x.shape[0] == 1 and x.is_contiguous())
    monkeypatch.setattr(linear_method, "gemv", counted_gemv)
    llm = LLM(path, device="cpu", kvcache_block_size=16, max_model_len=128, max_num_seqs=1)
    try:
        prompts = [[5]]  # a one-token prompt: its prefill takes the GEMV too (the interpreter is slow)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(path, p, o["token_ids"])
    finally:
        llm.exit()
    assert len(calls) >= 5 * 3 and any(calls), "the one-row steps did not go through the (fused) GEMV"
