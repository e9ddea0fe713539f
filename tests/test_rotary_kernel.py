"""kernels/rotary.py's rotate_ (under the Triton interpreter on CPU, compiled on CUDA) against
layers/rotary_embedding.py's apply_rotary: the same values in float32, and 16-bit floats rounded the same way,
on views with a head stride (q and k inside a fused qkv row) and head dims that are not powers of two."""
import pytest
import torch

from nanoinfer.kernels.rotary import rotate_
from nanoinfer.layers.rotary_embedding import apply_rotary

# Triton's interpreter on the CPU, which does not round to bfloat16 as the GPU does: float16 there
CASES = [("cuda", torch.float32), ("cuda", torch.bfloat16)] if torch.cuda.is_available() else \
    [("cpu", torch.float32), ("cpu", torch.float16)]


def table(n, dim, gen, device):
    freqs = torch.rand(n, dim // 2, generator=gen) * 50
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("heads,dim", [(2, 80), (3, 16), (16, 80)])
def test_rotate_matches_apply_rotary(device, dtype, heads, dim):
    gen = torch.Generator().manual_seed(heads * dim)
    n = 37
    qkv = torch.randn(n, 3 * heads, dim, generator=gen).to(device, dtype)
    cos_sin = table(n, dim, gen, device)
    rows = torch.arange(n, device=device)
    want = torch.cat([apply_rotary(qkv[:, :heads], rows, cos_sin), apply_rotary(qkv[:, heads:2 * heads], rows, cos_sin),
                      qkv[:, 2 * heads:]], dim=1)
    got = qkv.clone()
    rotate_(got[:, :2 * heads], cos_sin)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # one float32 rounding apart at most (fused multiply-adds), then the same 16-bit rounding
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
        assert (got != want).float().mean() < 0.01
    assert torch.equal(got[:, 2 * heads:], qkv[:, 2 * heads:])  # v untouched


def test_rotate_checks_its_inputs():
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="float32"):
        rotate_(x, torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        rotate_(x.transpose(1, 2), torch.randn(4, 2))
    assert rotate_(x[:0], torch.randn(0, 8)).shape == (0, 2, 8)
