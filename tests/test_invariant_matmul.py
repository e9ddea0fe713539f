"""kernels/invariant_matmul.py: a row's product is bitwise the same whatever the other rows and
whatever the tiles (CPU: Triton's interpreter, float32; GPU: bfloat16, against cuBLAS's split-K)."""
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels import invariant_matmul as im
from nanoinfer.kernels.invariant_matmul import invariant_config, invariant_matmul

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_rows_do_not_depend_on_the_rows_beside_and_match_f_linear():
    torch.manual_seed(0)
    x, w, b = torch.randn(70, 96, device=DEV), torch.randn(80, 96, device=DEV), torch.randn(80, device=DEV)
    whole = invariant_matmul(x, w, b)
    torch.testing.assert_close(whole, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for start, rows in ((0, 1), (5, 2), (17, 33), (3, 67)):
        assert torch.equal(invariant_matmul(x[start:start + rows], w, b), whole[start:start + rows])
    out = torch.empty(70, 80, device=DEV)
    assert invariant_matmul(x, w, out=out) is out and torch.equal(out, invariant_matmul(x, w))
    assert invariant_matmul(x[:0], w).shape == (0, 80)


def test_tiles_follow_the_rows_and_fill_the_sms(monkeypatch):
    monkeypatch.setattr(im, "TUNED", {})  # (the rules for shapes with no tuned tiles)
    few = invariant_config(128, 4096, 4096, torch.bfloat16)
    assert invariant_config(1, 4096, 4096, torch.bfloat16) == few and few["block_n"] == 32
    k = 96  # (no tuned shape)
    assert invariant_config(4096, 4096, k, torch.bfloat16)["block_m"] == 128
    assert invariant_config(256, 24576, k, torch.bfloat16)["block_n"] == 256  # 2 x 96 tiles fill 132 SMs
    assert invariant_config(256, 4096, k, torch.bfloat16)["block_n"] == 64  # wider tiles would leave SMs idle
    assert invariant_config(256, 1024, k, torch.bfloat16)["block_n"] == 32


def test_tuned_tiles_apply_to_their_shape_and_row_bucket(monkeypatch):
    monkeypatch.setattr(im, "TUNED", {(512, 4096, 1024): (64, 128, 64, 4, 5), (16, 4096, 1024): (64, 16, 256, 4, 3)})
    assert im.rows_bucket(1) == 16 and im.rows_bucket(17) == 64 and im.rows_bucket(128) == 128
    assert im.rows_bucket(129) == 256 and im.rows_bucket(257) == 512 and im.rows_bucket(100_000) == 2048
    for m in (257, 400, 512):
        assert invariant_config(m, 4096, 1024, torch.bfloat16) == im._as_config((64, 128, 64, 4, 5))
    for m in (1, 16):
        assert invariant_config(m, 4096, 1024, torch.bfloat16) == im._as_config((64, 16, 256, 4, 3))
    assert invariant_config(17, 4096, 1024, torch.bfloat16) == im._as_config(im._FEW_ROWS)
    for m, n, k in ((256, 4096, 1024), (513, 4096, 1024), (400, 4096, 2048), (64, 4096, 1024)):
        assert invariant_config(m, n, k, torch.bfloat16) != im._as_config((64, 128, 64, 4, 5))


@pytest.mark.skipif(im.TensorDescriptor is None, reason="Triton without tensor descriptors")
@pytest.mark.parametrize("programs", [7, 40])
def test_persistent_tma_kernel_equals_the_pointer_kernel_bitwise(programs):
    """The kernel of more than FEW_ROWS_MAX rows on Hopper, here in Triton's interpreter (float16; on
    the GPU the CUDA test below compares them): one program walking several tiles (7 programs), or
    programs past the last tile (40), gives the pointer kernel's bits, bias and ragged edges included."""
    if DEV == "cuda":
        pytest.skip("the interpreter's run (CPU); on CUDA test_cuda_bf16_rows_and_tiles_agree_bitwise covers it")
    torch.manual_seed(3)
    x, w, b = (torch.randn(300, 64).half(), torch.randn(100, 64).half(), torch.randn(100).half())
    out = torch.zeros(300, 100, dtype=torch.float16)
    im._tma_persistent_kernel[(programs,)](
        im.TensorDescriptor.from_tensor(x, [64, 32]), im.TensorDescriptor.from_tensor(w, [32, 32]), b, out,
        300, 100, 64, out.stride(0), HAS_BIAS=True, BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, GROUP_M=8,
        NUM_PROGRAMS=programs)
    assert torch.equal(out, invariant_matmul(x, w, b, config=im._as_config((64, 32, 32, 4, 3))))
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=1e-2, atol=1e-2)


def test_shapes_that_do_not_multiply_are_refused():
    with pytest.raises(ValueError, match="do not multiply"):
        invariant_matmul(torch.randn(3, 8, device=DEV), torch.randn(4, 9, device=DEV))


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 3072), (6144, 1024), (200, 96)])
def test_cuda_bf16_rows_and_tiles_agree_bitwise(n, k):
    """The tiles follow the number of rows (invariant_config): that is safe only because every tile
    shape sums K in the same order. Checked here over the configs it picks and others; and cuBLAS,
    which splits K for few rows, does differ (so the comparison can fail)."""
    torch.manual_seed(1)
    x = torch.randn(600, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    whole = invariant_matmul(x, w)
    configs = [im._as_config(tiles) for tiles in (im._FEW_ROWS, *im._BY_WIDTH, *im.TUNED.values(), (16, 64, 64, 4, 3),
                                                  (64, 16, 128, 4, 4), (128, 128, 32, 8, 3))]
    for config in configs:
        assert torch.equal(invariant_matmul(x, w, config=config), whole)
    for rows in (1, 3, 64, 129, 513):  # (up to 128 rows the pointer kernel, more the TMA one on Hopper)
        assert torch.equal(invariant_matmul(x[:rows], w), whole[:rows])
    torch.testing.assert_close(whole.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    if (n, k) == (4096, 4096):
        assert any(not torch.equal(F.linear(x[:rows], w), F.linear(x, w)[:rows]) for rows in (1, 2, 4, 8, 16))
