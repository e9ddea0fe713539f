"""The Triton RMSNorm / add+RMSNorm / SiLU*mul kernels against their torch references (the CPU path):
under TRITON_INTERPRET=1 on CPU (float32, float16), and in bf16 on a GPU."""
import pytest
import torch

from nanoinfer.kernels import norm_act
from nanoinfer.layers.activation import silu_and_mul
from nanoinfer.layers.layernorm import add_rms_norm, rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(1, 64), (5, 96), (17, 1024), (3, 1000)]  # rows, width (powers of two and not)


def dtypes():
    return [torch.bfloat16, torch.float32] if DEV == "cuda" else [torch.float32, torch.float16]


def assert_close(out, ref, dtype):
    """float32: equal up to summation order; 16-bit: at most about one rounding step apart."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows, width", CASES)
@pytest.mark.parametrize("dtype", dtypes())
def test_rms_norm_matches_torch(rows, width, dtype):
    g = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=g) * 3).to(DEV, dtype)
    res = torch.randn(rows, width, generator=g).to(DEV, dtype)
    w = (torch.rand(width, generator=g) + 0.5).to(DEV, dtype)
    assert_close(norm_act.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype)
    out, new_res = norm_act.rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res), "the residual sum rounds once, as torch does"
    assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("rows, width", CASES + [(2, 3072)])
@pytest.mark.parametrize("dtype", dtypes())
def test_silu_and_mul_matches_torch(rows, width, dtype):
    g = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, 2 * width, generator=g) * 4).to(DEV, dtype)
    out = norm_act.silu_and_mul(x)
    ref = silu_and_mul(x)
    assert out.shape == (rows, width)
    assert_close(out, ref, dtype)


def test_empty_batch():
    x = torch.empty(0, 64, device=DEV)
    assert norm_act.rms_norm(x, torch.ones(64, device=DEV), 1e-6).shape == (0, 64)
    assert norm_act.silu_and_mul(torch.empty(0, 128, device=DEV)).shape == (0, 64)
