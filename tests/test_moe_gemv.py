"""The few-token MoE kernels and the routing kernel (kernels/moe_gemv.py; interpreter on CPU, real
on GPU) against the torch paths they replace: layers/fused_moe.py select_experts and
fused_moe_torch, and the grouped kernel (kernels/fused_moe.py) at the model's dtype."""
import pytest
import torch

from nanoinfer.kernels.fused_moe import fused_moe
from nanoinfer.kernels.moe_gemv import moe_gemv, route_topk
from nanoinfer.layers.fused_moe import fused_moe_torch, select_experts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def experts(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype)


@pytest.mark.parametrize("m,num_experts,top_k,renormalize", [(1, 8, 2, True), (3, 6, 3, False), (5, 128, 8, True),
                                                              (2, 5, 5, True)])
def test_route_topk_matches_select_experts(m, num_experts, top_k, renormalize):
    logits = torch.randn(m, num_experts, generator=torch.Generator().manual_seed(m)).to(DEV)
    weights, ids = route_topk(logits, top_k, renormalize)
    ref_w, ref_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_route_topk_reads_bf16_logits_and_strided_rows():
    logits = torch.randn(4, 24, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    wide = torch.zeros(4, 40, dtype=torch.bfloat16, device=DEV)
    wide[:, :24] = logits
    weights, ids = route_topk(wide[:, :24], 4, True)
    ref_w, ref_ids = select_experts(logits, 4, True)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("m,num_experts,top_k,hidden,inter", [(1, 8, 2, 48, 40), (4, 6, 3, 64, 24),
                                                               (2, 4, 4, 32, 72), (3, 16, 1, 40, 16)])
def test_moe_gemv_matches_torch_float32(m, num_experts, top_k, hidden, inter):
    w13, w2 = experts(num_experts, hidden, inter, torch.float32)
    x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(1)).to(DEV)
    logits = torch.randn(m, num_experts, generator=torch.Generator().manual_seed(2)).to(DEV)
    weights, ids = route_topk(logits, top_k, True)
    out = moe_gemv(x, w13, w2, weights, ids)
    ref = fused_moe_torch(x, w13, w2, weights, ids.long())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_moe_gemv_small_tiles_and_bf16_match_grouped_kernel():
    """Several K tiles and N tiles with ragged ends; bf16 against the grouped kernel's roundings."""
    w13, w2 = experts(8, 96, 40, torch.bfloat16)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4)).to(DEV, torch.bfloat16)
    weights, ids = route_topk(torch.randn(3, 8, generator=torch.Generator().manual_seed(5)).to(DEV), 2, True)
    cfg = dict(gate_up=dict(BLOCK_N=16, BLOCK_K=32, num_warps=4), down=dict(BLOCK_N=32, BLOCK_K=16, num_warps=4))
    out = moe_gemv(x, w13, w2, weights, ids, cfg)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids.long())
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    if DEV == "cuda":  # (the interpreter's bf16 dot, in the grouped kernel, is not the GPU's)
        grouped = fused_moe(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), grouped.float(), atol=2e-2, rtol=2e-2)


def test_moe_gemv_rejects_bad_shapes():
    w13, w2 = experts(4, 32, 16, torch.float32)
    x = torch.randn(2, 32, device=DEV)
    weights, ids = route_topk(torch.randn(2, 4, device=DEV), 2, True)
    with pytest.raises(ValueError, match="moe_gemv shapes"):
        moe_gemv(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="route_topk"):
        route_topk(torch.randn(2, 4, device=DEV), 5, True)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4])
def test_moe_gemv_at_the_30b_a3b_shape_cuda(m):
    """The real shape (hidden 2048, 128 experts, top-8, intermediate 768), bf16, default tiles:
    close to the float32 torch reference and to the grouped kernel."""
    w13, w2 = experts(128, 2048, 768, torch.bfloat16)
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(DEV, torch.bfloat16)
    weights, ids = route_topk(torch.randn(m, 128, device=DEV), 8, True)
    out = torch.full_like(x, float("nan"))
    out.copy_(moe_gemv(x, w13, w2, weights, ids))
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids.long())
    assert (out.float() - ref).norm() / ref.norm() < 1e-2
    grouped = fused_moe(x, w13, w2, weights, ids)
    assert (out.float() - grouped.float()).norm() / grouped.norm() < 5e-3


def test_moe_layer_on_the_kernels_matches_hf(monkeypatch, tmp_path):
    """FusedMoE's CUDA path (route_topk, then moe_gemv up to GEMV_MAX_TOKENS tokens, else the grouped
    kernel) in the model, run in the interpreter on CPU where there is no GPU: greedy tokens are
    HF's argmax at every position (float32). Decode steps of 1-3 rows take moe_gemv, prompts the
    grouped kernel."""
    from hf_reference import assert_greedy_matches_hf
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.layers import fused_moe as layer
    from nanoinfer.utils.tiny_moe import build_tiny_moe_checkpoint
    monkeypatch.setattr(layer, "runs_kernels", lambda x: True)
    path = build_tiny_moe_checkpoint(str(tmp_path))
    llm = LLM(path, kvcache_block_size=16, max_model_len=128, enforce_eager=True)
    try:
        prompts = ["Hello, my name is", [(i * 37) % llm.vocab_size for i in range(1, 30)], "The quick brown fox"]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for prompt, out in zip(prompts, [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]):
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            assert_greedy_matches_hf(path, ids, out, tol=1e-3)
    finally:
        llm.exit()
