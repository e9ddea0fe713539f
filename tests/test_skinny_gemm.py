"""The few-row GEMM kernel (kernels/skinny_gemm.py), plain, split over K, and with its RMSNorm /
SiLU*mul prologues, against the torch path it replaces: under TRITON_INTERPRET=1 on CPU (float32),
and on a GPU (bfloat16, float32) at the 0.6B and 8B shapes with their default configs too."""
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels.skinny_gemm import default_config, skinny_gemm
from nanoinfer.layers.activation import silu_and_mul
from nanoinfer.layers.layernorm import add_rms_norm, rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K, config): row, feature and K tails; one K split, three (uneven), none
CASES = [(3, 40, 96, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)), (8, 64, 256, dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)),
         (5, 48, 392, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3)), (17, 20, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1))]
if DEV == "cuda":  # (marked, so that `pytest -m cuda` runs them; the small cases run in any GPU session)
    CASES += [pytest.param(m, n, k, None, marks=pytest.mark.cuda) for m in (2, 8, 24, 64)
              for n, k in [(4096, 1024), (1024, 2048), (6144, 4096), (4096, 12288)]]


def config(m, cfg):
    if cfg is None:
        return None
    return dict(cfg, BLOCK_M=max(16, 1 << (m - 1).bit_length()), num_warps=4, num_stages=2)


def dtypes():
    return [torch.bfloat16, torch.float32] if DEV == "cuda" else [torch.float32]


def assert_close(out, ref, dtype):
    """Equal up to summation order, plus one rounding of the output in 16 bits."""
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


def tensors(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)  # noqa: E731
    return (make(m, k, scale=3), make(n, k, scale=k ** -0.5), make(n), make(m, k),
            (torch.rand(k, generator=g) + 0.5).to(DEV, dtype))


@pytest.mark.parametrize("m, n, k, cfg", CASES)
@pytest.mark.parametrize("dtype", dtypes())
def test_plain_bias_and_repeat(m, n, k, cfg, dtype):
    x, w, b, _, _ = tensors(m, n, k, dtype, n + k)
    for _ in range(2):  # the split-K arrival counters are back at zero after a call
        assert_close(skinny_gemm(x, w, config=config(m, cfg)), F.linear(x.float(), w.float()), dtype)
    assert_close(skinny_gemm(x, w, b, config=config(m, cfg)), F.linear(x.float(), w.float(), b.float()), dtype)
    out = torch.empty(m + 3, n, dtype=dtype, device=DEV)[:m]
    assert skinny_gemm(x, w, out=out, config=config(m, cfg)) is out
    assert_close(out, F.linear(x.float(), w.float()), dtype)
    wide = torch.zeros(m, k + 8, dtype=dtype, device=DEV)  # rows with a stride: a slice of a wider buffer
    wide[:, :k] = x
    assert_close(skinny_gemm(wide[:, :k], w, config=config(m, cfg)), F.linear(x.float(), w.float()), dtype)


@pytest.mark.parametrize("m, n, k, cfg", CASES)
@pytest.mark.parametrize("dtype", dtypes())
def test_rms_norm_prologue(m, n, k, cfg, dtype):
    """y = add_rms_norm(x, residual) @ W^T, and the new residual stored exactly as torch rounds it."""
    x, w, _, res, nw = tensors(m, n, k, dtype, 2 * n + k)
    out = torch.empty_like(res)
    y = skinny_gemm(x, w, norm_weight=nw, eps=1e-6, residual=res, residual_out=out, config=config(m, cfg))
    normed, ref_res = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(out, ref_res)
    assert_close(y, F.linear(normed.float(), w.float()), dtype)
    assert_close(skinny_gemm(x, w, norm_weight=nw, eps=1e-6, config=config(m, cfg)),
                 F.linear(rms_norm(x, nw, 1e-6).float(), w.float()), dtype)


@pytest.mark.parametrize("m, n, k, cfg", CASES)
@pytest.mark.parametrize("dtype", dtypes())
def test_silu_mul_prologue(m, n, k, cfg, dtype):
    g = torch.Generator().manual_seed(n * k)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 4).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    assert_close(skinny_gemm(gate_up, w, silu_mul=True, config=config(m, cfg)),
                 F.linear(silu_and_mul(gate_up).float(), w.float()), dtype)


def test_default_config_fills_the_gpu():
    for m, n, k in [(8, 1024, 2048), (8, 4096, 1024), (32, 6144, 4096), (64, 151936, 1024)]:
        cfg = default_config(m, n, k)
        assert cfg["BLOCK_M"] >= m and -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"] >= 64


def test_bad_shapes_are_refused():
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        skinny_gemm(torch.zeros(65, 16, device=DEV), w)
    with pytest.raises(ValueError, match="contiguous features"):
        skinny_gemm(torch.zeros(2, 16, device=DEV), w, silu_mul=True)
    x, nw, res = torch.zeros(2, 16, device=DEV), torch.ones(16, device=DEV), torch.zeros(2, 16, device=DEV)
    with pytest.raises(ValueError, match="residual_out"):
        skinny_gemm(x, w, norm_weight=nw, residual=res)
    with pytest.raises(ValueError, match="must not share memory"):
        skinny_gemm(x, w, norm_weight=nw, residual=res, residual_out=res)
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_gemm(x, w, norm_weight=torch.ones(8, device=DEV))


@pytest.mark.cuda
@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [2, 3, 5, 16, 17])
def test_linear_routes_few_rows_of_small_weights_here(monkeypatch, rows):
    """linear() takes this kernel for 3-16 bf16 rows against an o_proj-like weight (1024 x 2048;
    2 rows take the GEMV), cuBLAS otherwise, with the same result up to summation order."""
    from nanoinfer.layers import linear_method
    calls = []
    monkeypatch.setattr(linear_method, "skinny_gemm", lambda *a, **kw: calls.append(1) or skinny_gemm(*a, **kw))
    x, w, _, _, _ = tensors(rows, 1024, 2048, torch.bfloat16, rows)
    assert_close(linear_method.linear(x, w), F.linear(x.float(), w.float()), torch.bfloat16)
    assert len(calls) == (3 <= rows <= 16)
    assert linear_method.few_row_kernel(x.float(), w.float()) is None  # float32 keeps cuBLAS
