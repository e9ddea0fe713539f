"""The Triton LoRA expand (kernels/lora_expand.py) against the torch path of lora/linear.py (mask
the shrink by slot, then addmm): under TRITON_INTERPRET=1 on CPU in float32, and on a GPU in bf16."""
import pytest
import torch

from nanoinfer.kernels.lora_expand import lora_expand
from nanoinfer.lora.linear import slot_mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def torch_expand(t, b, slots, y, num_slots):
    masked = t.view(t.shape[0], num_slots, -1) * slot_mask(slots, num_slots, t.dtype).unsqueeze(-1)
    return y.addmm(masked.view(t.shape[0], -1), b.t())


@pytest.mark.parametrize("rows, n, num_slots, width", [(1, 40, 1, 8), (5, 96, 3, 24), (33, 70, 4, 48),
                                                       (80, 64, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32])
def test_expand_matches_the_torch_path(rows, n, num_slots, width, dtype):
    g = torch.Generator().manual_seed(rows * n + width)
    t = torch.randn(rows, num_slots * width, generator=g).to(DEV, dtype)
    b = torch.randn(n, num_slots * width, generator=g).to(DEV, dtype)
    y = torch.randn(rows, n, generator=g).to(DEV, dtype)
    slots = torch.randint(-1, num_slots, (rows,), generator=g).to(DEV)
    expected = torch_expand(t, b, slots, y, num_slots)
    out = lora_expand(t, b, slots, y.clone(), num_slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    base = (slots == -1).nonzero().flatten()
    assert torch.equal(out[base], y[base]), "rows of the base model are left exactly as they were"


def test_a_block_of_one_slot_reads_only_that_slot():
    """Rows of one slot: another slot's B, even non-finite, never reaches them."""
    t = torch.randn(20, 2 * 16, device=DEV)
    b = torch.randn(32, 2 * 16, device=DEV)
    b[:, 16:] = float("nan")
    y = torch.zeros(20, 32, device=DEV)
    out = lora_expand(t, b, torch.zeros(20, dtype=torch.int64, device=DEV), y, 2)
    torch.testing.assert_close(out, t[:, :16] @ b[:, :16].t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 37])
def test_expand_from_a_joint_product_into_out(rows):
    """The fused shrink's layout (lora/linear.py over a dense base): y and t are column blocks of one
    [rows, n + S * W] product, rows strided; the sum goes to a contiguous `out`, the product stays."""
    num_slots, width, n = 3, 16, 72
    g = torch.Generator().manual_seed(rows)
    both = torch.randn(rows, n + num_slots * width, generator=g).to(DEV)
    b = torch.randn(n, num_slots * width, generator=g).to(DEV)
    slots = torch.randint(-1, num_slots, (rows,), generator=g).to(DEV)
    y, t = both[:, :n], both[:, n:]
    kept = both.clone()
    out = torch.full((rows, n), float("nan"), device=DEV)
    got = lora_expand(t, b, slots, y, num_slots, out=out)
    assert got is out and torch.equal(both, kept)
    torch.testing.assert_close(out, torch_expand(t.contiguous(), b, slots, y, num_slots), rtol=1e-4, atol=1e-4)
