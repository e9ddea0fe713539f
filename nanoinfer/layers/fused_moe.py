"""Mixture-of-experts MLP: router softmax + top-k, then every expert's SiLU MLP over its tokens.

Expert weights are stacked as [E, 2I, H] (each expert's gate rows, then its up rows) and [E, H, I],
filled one checkpoint tensor at a time by the loader (shard ids (expert, 0 | 1) and expert). Tensor
parallel: each rank holds a slice of every expert's intermediate dimension (gate/up column-split,
down row-split); the combined output is all-reduced once. The router is replicated.

CUDA runs our Triton kernel (kernels/fused_moe.py); elsewhere `fused_moe_torch`, the reference.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.all_reduce import AllReduce
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.model_build import ModelBuild, TensorParallel, join
from nanoinfer.utils.loader import check_shape


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over the experts, then the top_k, renormalised to sum to 1 when asked; float32 on
    every device and dtype (as HF computes the routing). Returns (weights float32, ids int64) [M, top_k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference: for each expert, its (token, slot) pairs through silu(gate) * up and down, scaled by
    the routing weight and added to the token's output. Same operation order as HF's eager experts."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync: CPU/reference only
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens, slots = pairs // topk_ids.shape[1], pairs % topk_ids.shape[1]
        gate_up = F.linear(x[tokens], w13[expert])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[expert]) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


class ExpertsGateUp(nn.Module):
    """Every expert's gate and up projections, stacked: weight [E, 2 * I / tp, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp: TensorParallel):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.local = intermediate_size // self.tp_size
        self.weight = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = [(e, j) for e in range(num_experts) for j in (0, 1)]  # the loader checks all came

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]):
        expert, part = shard_id  # part 0: gate, 1: up
        check_shape(loaded, (self.local * self.tp_size, param.shape[2]))
        rows = loaded.narrow(0, self.tp_rank * self.local, self.local)
        param.data[expert].narrow(0, part * self.local, self.local).copy_(rows)


class ExpertsDown(nn.Module):
    """Every expert's down projection, stacked: weight [E, H, I / tp]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp: TensorParallel):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.local = intermediate_size // self.tp_size
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = list(range(num_experts))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert: int):
        check_shape(loaded, (param.shape[1], self.local * self.tp_size))
        param.data[expert].copy_(loaded.narrow(1, self.tp_rank * self.local, self.local))  # loaded [H, I]


class FusedMoE(nn.Module):
    """The sparse MLP block: `gate` (the router, [E, H]) and `experts` (stacked weights). Submodule
    names follow the checkpoints' (mlp.gate, mlp.experts.N.*). Its input is used twice (router and
    experts), so it takes no Deferred input; it all-reduces its own output."""
    accepts_deferred = False

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 *, build: ModelBuild, prefix: str):
        super().__init__()
        tp_size = build.tp.size
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        if intermediate_size % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the experts' intermediate size "
                             f"{intermediate_size}")
        self.num_experts, self.top_k, self.renormalize, self.tp_size = num_experts, top_k, renormalize, tp_size
        self.gate = ReplicatedLinear(hidden_size, num_experts, build=build, prefix=join(prefix, "gate"))
        self.experts = nn.Module()
        self.experts.gate_up_proj = ExpertsGateUp(num_experts, hidden_size, intermediate_size, tp=build.tp)
        self.experts.down_proj = ExpertsDown(num_experts, hidden_size, intermediate_size, tp=build.tp)
        if tp_size > 1:
            self.all_reduce = AllReduce(hidden_size)

    def forward(self, x: torch.Tensor, reduce_later: bool = False) -> torch.Tensor:
        """reduce_later (the caller could take a PartialSum) is not taken up: the output is summed here."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        w13, w2 = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        if x.is_cuda:
            from nanoinfer.kernels.fused_moe import fused_moe
            out = fused_moe(x, w13, w2, weights, ids)
        else:
            out = fused_moe_torch(x, w13, w2, weights, ids)
        if self.tp_size > 1:
            out = self.all_reduce(out)
        return out
