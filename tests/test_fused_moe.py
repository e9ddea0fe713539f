"""The fused MoE Triton kernel (interpreter on CPU, real on GPU) against the torch path it replaces,
layers/fused_moe.py fused_moe_torch; and moe_align's sorted, padded layout against its definition;
pairs of expert id -1 (expert parallel: another rank's) skipped by both expert kernels."""
import pytest
import torch

from nanoinfer.kernels.fused_moe import fused_moe, max_padded_rows, moe_align
from nanoinfer.kernels.moe_gemv import moe_gemv
from nanoinfer.layers.fused_moe import fused_moe_torch, select_experts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def routing(m, num_experts, top_k, skew=0.0, renormalize=True, seed=0):
    """Router logits with `skew` pushing tokens toward the first experts (uneven loads, idle experts)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, num_experts, generator=g) - skew * torch.arange(num_experts, dtype=torch.float32)
    weights, ids = select_experts(logits.to(DEV), top_k, renormalize)
    return weights, ids


def weights_for(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype)


def check(m, num_experts, top_k, hidden, inter, dtype=torch.float32, skew=0.0, renormalize=True, config=None):
    w13, w2 = weights_for(num_experts, hidden, inter, dtype)
    x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    weights, ids = routing(m, num_experts, top_k, skew, renormalize)
    out = fused_moe(x, w13, w2, weights, ids, config)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)  # float32 reference
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    return ids


@pytest.mark.parametrize("m,num_experts,top_k", [(1, 8, 2), (5, 4, 1), (13, 6, 3), (40, 16, 4), (9, 3, 3)])
def test_matches_torch_float32(m, num_experts, top_k):
    check(m, num_experts, top_k, hidden=48, inter=40)


def test_uneven_loads_and_idle_experts():
    ids = check(24, 8, 2, hidden=32, inter=24, skew=3.0)
    loads = torch.bincount(ids.flatten().cpu(), minlength=8)
    assert (loads == 0).any() and loads.max() >= 12, loads  # the case this test is for


def test_weights_not_renormalised_and_float16():
    check(11, 8, 2, hidden=32, inter=32, renormalize=False)
    check(11, 8, 2, hidden=32, inter=32, dtype=torch.float16)


@pytest.mark.parametrize("m", [3, 24])
def test_expert_kernels_skip_another_ranks_pairs(m):
    """Expert id -1 (another rank's expert): the grouped kernel and the few-token kernels add nothing
    for that pair, as the torch path (Triton's interpreter on CPU)."""
    g = torch.Generator().manual_seed(m)
    w13, w2 = weights_for(4, 32, 16, torch.float32, seed=m)
    x = torch.randn(m, 32, generator=g).to(DEV)
    weights, ids = select_experts(torch.randn(m, 8, generator=g).to(DEV), 3, True)
    local = torch.where(ids < 4, ids, -1)  # this rank holds experts 0-3 of 8
    assert (local == -1).any() and (local >= 0).any()
    masked = weights * (local >= 0)
    expected = fused_moe_torch(x, w13, w2, masked, local.clamp(min=0))
    torch.testing.assert_close(fused_moe_torch(x, w13, w2, weights, local), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, local, skipped_pairs=True), expected,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe_gemv(x, w13, w2, weights, local.to(torch.int32)), expected, atol=1e-5, rtol=1e-5)


def test_tile_sizes_do_not_change_results():
    """Each row's result depends on its row only: another BLOCK_M (padding, sorting) gives the same bits."""
    w13, w2 = weights_for(8, 32, 48, torch.float32)
    x = torch.randn(20, 32, device=DEV)
    weights, ids = routing(20, 8, 2)
    a = fused_moe(x, w13, w2, weights, ids, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32))
    b = fused_moe(x, w13, w2, weights, ids, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32))
    assert torch.equal(a, b)


def test_ordered_sum_adds_each_tokens_slots_in_order():
    """ordered_sum (the batch-invariant MoE): slot 0 + slot 1 + ... in float32, exactly; the same
    tokens alone and inside a larger batch give the same bits."""
    w13, w2 = weights_for(8, 32, 48, torch.float32)
    x = torch.randn(20, 32, device=DEV)
    weights, ids = routing(20, 8, 3)
    whole = fused_moe(x, w13, w2, weights, ids, ordered_sum=True)
    slots = torch.stack([fused_moe(x, w13, w2, weights[:, k:k + 1], ids[:, k:k + 1]) for k in range(3)], 1)
    assert torch.equal(whole, slots[:, 0] + slots[:, 1] + slots[:, 2])
    torch.testing.assert_close(whole, fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(fused_moe(x[3:5], w13, w2, weights[3:5], ids[3:5], ordered_sum=True), whole[3:5])


@pytest.mark.parametrize("m,num_experts,top_k,block_m", [(1, 8, 2, 16), (70, 8, 4, 16), (30, 5, 2, 32),
                                                          (3, 64, 8, 16)])
def test_moe_align_layout(m, num_experts, top_k, block_m):
    """Each expert's pairs, in pair order, in a segment padded to block_m with the sentinel M*top_k;
    each block's expert; segments in expert order. (70 x 4 pairs span two counting chunks.)"""
    _, ids = routing(m, num_experts, top_k, skew=1.0)
    sorted_ids, block_expert, num_padded = moe_align(ids, num_experts, block_m)
    flat, sentinel = ids.flatten().cpu(), m * top_k
    sorted_ids, block_expert, total = sorted_ids.cpu(), block_expert.cpu(), int(num_padded.item())
    assert sorted_ids.numel() >= max_padded_rows(sentinel, num_experts, block_m) and total % block_m == 0
    pos = 0
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten()
        size = -(-len(pairs) // block_m) * block_m
        segment = sorted_ids[pos:pos + size]
        assert segment[:len(pairs)].tolist() == pairs.tolist()
        assert (segment[len(pairs):] == sentinel).all()
        assert (block_expert[pos // block_m:(pos + size) // block_m] == e).all()
        pos += size
    assert total == pos


def test_empty_batch_and_bad_shapes():
    w13, w2 = weights_for(4, 16, 8, torch.float32)
    empty = torch.empty(0, 2, dtype=torch.int64, device=DEV)
    assert fused_moe(torch.empty(0, 16, device=DEV), w13, w2, empty.float(), empty).shape == (0, 16)
    x = torch.randn(3, 16, device=DEV)
    weights, ids = routing(3, 4, 2)
    with pytest.raises(ValueError, match="fused_moe shapes"):
        fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="fused_moe shapes"):
        fused_moe(x[:2], w13, w2, weights, ids)


# ---------------------------------------------------------------------------------------- GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 7, 64, 256, 1000, 4096])
@pytest.mark.parametrize("num_experts,top_k,hidden,inter", [(128, 8, 2048, 768), (8, 2, 1024, 1792), (60, 4, 512, 352)])
def test_bf16_real_shapes(m, num_experts, top_k, hidden, inter):
    check(m, num_experts, top_k, hidden, inter, dtype=torch.bfloat16, skew=0.02)


@pytest.mark.cuda
def test_cuda_graph_replay_follows_new_routing():
    """Captured once; replays with other routing (other expert loads) give the eager results: nothing
    about the routing was baked into the graph."""
    w13, w2 = weights_for(16, 256, 128, torch.bfloat16)
    x = torch.randn(32, 256, device=DEV, dtype=torch.bfloat16)
    weights, ids = routing(32, 16, 4)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed, skew in [(1, 0.0), (2, 4.0), (3, 0.5)]:
        new_w, new_ids = routing(32, 16, 4, skew=skew, seed=seed)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        x.normal_()
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids), atol=0, rtol=0)


def test_benchmark_runs_and_counts_routed_experts(capsys):
    """python -m nanoinfer.bench.moe end to end on tiny shapes with a stub timer (it needs a GPU to time),
    and the bytes/FLOPs it gives bench.py's lower bound."""
    from types import SimpleNamespace

    from nanoinfer.bench import moe as bench_moe
    args = bench_moe.parse_args("--tokens 1 5 --hidden 32 --inter 16 --experts 4 --top-k 2".split())
    bench_moe.bench(args, torch.device(DEV), torch.float32, timer=lambda fn, graph: (fn(), 1.0)[1],
                    ceilings=lambda device: (4e12, 7e14))
    out = capsys.readouterr().out
    assert "M = 5 tokens" in out and "torch loop" in out

    hf = SimpleNamespace(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, hidden_size=2048,
                         num_hidden_layers=48, decoder_sparse_step=2, mlp_only_layers=[1])
    expert = 3 * 2048 * 768
    nbytes, flops = bench_moe.moe_step_costs(hf, 2, tokens=1)  # 23 sparse layers (3, 5, ..., 47), 8 experts each
    assert nbytes == pytest.approx(23 * 8 * expert * 2) and flops == 23 * 2 * 8 * expert
    assert bench_moe.moe_step_costs(hf, 2, tokens=float("inf"))[0] == 23 * 128 * expert * 2
    hit = 128 * (1 - (120 / 128) ** 16)  # expected distinct experts for 16 tokens x top-8 of 128
    assert bench_moe.moe_step_costs(hf, 2, tokens=16, tp_size=2)[0] == pytest.approx(23 * hit * expert)
