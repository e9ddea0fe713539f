"""Mixture-of-experts MLP: router softmax + top-k, then every expert's SiLU MLP over its tokens.

Expert weights are stacked as [E, 2I, H] (each expert's gate rows, then its up rows) and [E, H, I],
filled one checkpoint tensor at a time by the loader (shard ids (expert, 0 | 1) and expert). FP8
checkpoints' experts load as float8 with their scales: the CUDA kernel reads them so (weight-only),
CPU dequantizes them once loaded. Tensor
parallel: each rank holds a slice of every expert's intermediate dimension (gate/up column-split,
down row-split); the combined output is all-reduced once. The router is replicated. Expert parallel
(ModelBuild.expert_parallel, nanoinfer/expert_parallel/): each rank holds E / N whole experts
instead, loads only their tensors, runs only the pairs routed to them, and the same all-reduce
combines the ranks' partial outputs.

CUDA runs our Triton kernel (kernels/fused_moe.py); elsewhere `fused_moe_torch`, the reference.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.expert_parallel.placement import ExpertLoad, ExpertPlacement
from nanoinfer.kernels.fused_moe import fp8_tile_k, fused_moe
from nanoinfer.kernels.moe_gemv import moe_gemv, route_topk
from nanoinfer.layers.all_reduce import AllReduce
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.model_build import ModelBuild, TensorParallel, join, whole_rows
from nanoinfer.quant import fp8_linear
from nanoinfer.quant.fp8_math import cdiv, check_block_cut, dequantize, group_k, quantize_rows, scale_rows
from nanoinfer.utils.loader import check_shape


GEMV_MAX_TOKENS = 4  # steps of at most this many tokens run the few-token expert kernels (CUDA)
FIXED_TILES = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)  # ModelBuild.fixed_kernels


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run this input (CUDA); elsewhere the torch path. (A function, so
    that CPU tests can run the kernels in Triton's interpreter.)"""
    return x.is_cuda


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over the experts, then the top_k, renormalised to sum to 1 when asked; float32 on
    every device and dtype (as HF computes the routing). Returns (weights float32, ids int64) [M, top_k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, rows_product=whole_rows) -> torch.Tensor:
    """Reference: for each expert, its (token, slot) pairs through silu(gate) * up and down, scaled by
    the routing weight and added to the token's output. Same operation order as HF's eager experts.
    A pair of expert id -1 (held by another rank: expert parallel) adds nothing. rows_product: as
    ModelBuild's, for the experts' two products."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (the -1 pairs first)
    counts = torch.bincount(flat_ids + 1, minlength=w13.shape[0] + 1).tolist()  # host sync: CPU/reference only
    start = counts[0]
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens, slots = pairs // topk_ids.shape[1], pairs % topk_ids.shape[1]
        gate_up = rows_product(lambda rows: F.linear(rows, w13[expert]), x[tokens])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = rows_product(lambda rows: F.linear(rows, w2[expert]), h) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


class _Experts(nn.Module):
    """Stacked expert weights [E, rows, cols]; with an FP8 scheme (quant/fp8_scheme.py) they load as
    float8 with scales [E, rows, ceil(cols / group_k)] (one scale row per output feature, as FP8
    linear layers hold them). On CUDA the fused-MoE kernel reads them as they are (weight-only FP8);
    on CPU they are dequantized to the model's dtype once loaded (the dequantized model, exactly)."""

    def __init__(self, experts: range, rows: int, cols: int, shard_ids: list, fp8, tp: TensorParallel):
        """experts: the (global) ids of the experts this rank holds, contiguous; shard_ids: theirs."""
        super().__init__()
        self.tp_rank, self.tp_size, self.fp8 = tp.rank, tp.size, fp8
        self.held = experts
        num_experts = len(experts)
        self.compute_dtype = torch.get_default_dtype()
        dtype = torch.float8_e4m3fn if fp8 is not None else None
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=dtype), requires_grad=False)
        params = [self.weight]
        if fp8 is not None:
            self.group_k = group_k(fp8, cols)
            scale = nn.Parameter(torch.empty(num_experts, rows, cdiv(cols, self.group_k), dtype=torch.float32),
                                 requires_grad=False)
            scale.dummy_value = 0.02
            scale.from_checkpoint = not fp8.online  # online: computed while the weight loads
            self.register_parameter(fp8.scale_name, scale)
            params.append(scale)
            if fp8.static_input:  # per-tensor activation scales: unused (the experts' FP8 is weight-only)
                self.input_scale = nn.Parameter(torch.empty(0), requires_grad=False)
                self.input_scale.dummy_value = 0.0
                params.append(self.input_scale)
        for param in params:
            param.weight_loader = self.weight_loader
            param.shard_ids = shard_ids  # the loader checks that all came
            param.held_elsewhere = self.held_elsewhere  # the loader skips those tensors unread

    def held_elsewhere(self, shard_id) -> bool:
        """Whether the shard's expert is another rank's (expert parallel)."""
        expert = shard_id[0] if isinstance(shard_id, tuple) else shard_id
        return isinstance(expert, int) and expert not in self.held

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id):
        if param is self.weight:
            checkpoint_fp8 = self.fp8 is not None and not self.fp8.online
            if (loaded.dtype == torch.float8_e4m3fn) != checkpoint_fp8:
                raise ValueError(f"dtype {loaded.dtype}: the experts are "
                                 f"{'FP8' if checkpoint_fp8 else 'not FP8'} in this model's checkpoint config")
            share = self.weight_share(loaded)
            if checkpoint_fp8 or self.fp8 is None:
                self.target(param, shard_id).copy_(share)
                return
            # online FP8: this rank's rows quantized, each row its own scale
            q, scale = quantize_rows(share.to(param.device))
            self.target(param, shard_id).copy_(q)
            self.target(self.scale, shard_id).copy_(scale)
        elif param is getattr(self, "input_scale", None):
            if loaded.numel() != 1:
                raise ValueError(f"size mismatch: expected one per-tensor input_scale, found {list(loaded.shape)}")
        else:
            self.target(param, shard_id).copy_(self.scale_share(loaded))

    @property
    def scale(self) -> torch.Tensor | None:
        """FP8: the scales [E, rows, ceil(cols / group_k)] (None for experts in the model's dtype)."""
        return None if self.fp8 is None else getattr(self, self.fp8.scale_name)

    @torch.no_grad()
    def process_weights_after_loading(self):
        """FP8 experts stay FP8 where the fused-MoE kernel runs them (CUDA, and scale groups it tiles);
        elsewhere (CPU) they are dequantized to the model's dtype."""
        if self.fp8 is None:
            return
        scale = self.scale
        if fp8_linear.keeps_fp8(self.weight.device) and fp8_tile_k(self.group_k, scale.shape[2], 128) is not None:
            if self.fp8.static_input:
                delattr(self, "input_scale")
            return
        dense = torch.empty(self.weight.shape, dtype=self.compute_dtype, device=self.weight.device)
        for e in range(dense.shape[0]):  # one expert at a time: a float32 copy of all would not fit
            dense[e] = dequantize(self.weight[e], scale[e], self.group_k, self.compute_dtype)
        delattr(self, self.fp8.scale_name)
        if self.fp8.static_input:
            delattr(self, "input_scale")
        self.weight = nn.Parameter(dense, requires_grad=False)
        self.fp8 = None


class ExpertsGateUp(_Experts):
    """Every expert's gate and up projections, stacked: weight [E, 2 * I / tp, H] (expert parallel:
    this rank's experts, whole: [E / N, 2 * I, H])."""

    def __init__(self, experts: range, hidden_size: int, intermediate_size: int, *, tp: TensorParallel, fp8=None):
        self.local = intermediate_size // tp.size
        super().__init__(experts, 2 * self.local, hidden_size, [(e, j) for e in experts for j in (0, 1)], fp8, tp)

    def target(self, param: nn.Parameter, shard_id: tuple[int, int]) -> torch.Tensor:
        expert, part = shard_id  # part 0: gate, 1: up
        return param.data[expert - self.held.start].narrow(0, part * self.local, self.local)

    def weight_share(self, loaded: torch.Tensor) -> torch.Tensor:
        check_shape(loaded, (self.local * self.tp_size, self.weight.shape[2]))
        return loaded.narrow(0, self.tp_rank * self.local, self.local)

    def scale_share(self, loaded: torch.Tensor) -> torch.Tensor:
        full = self.local * self.tp_size
        rows = scale_rows(self.fp8, loaded, full, self.weight.shape[2])
        check_block_cut(self.fp8, self.tp_rank * self.local, self.local, full, 0, "output")
        return rows.narrow(0, self.tp_rank * self.local, self.local)


class ExpertsDown(_Experts):
    """Every expert's down projection, stacked: weight [E, H, I / tp] (expert parallel: [E / N, H, I])."""

    def __init__(self, experts: range, hidden_size: int, intermediate_size: int, *, tp: TensorParallel, fp8=None):
        self.local = intermediate_size // tp.size
        super().__init__(experts, hidden_size, self.local, list(experts), fp8, tp)

    def target(self, param: nn.Parameter, expert: int) -> torch.Tensor:
        return param.data[expert - self.held.start]

    def weight_share(self, loaded: torch.Tensor) -> torch.Tensor:
        check_shape(loaded, (self.weight.shape[1], self.local * self.tp_size))
        return loaded.narrow(1, self.tp_rank * self.local, self.local)  # loaded [H, I]

    def scale_share(self, loaded: torch.Tensor) -> torch.Tensor:
        full, start = self.local * self.tp_size, self.tp_rank * self.local
        rows = scale_rows(self.fp8, loaded, self.weight.shape[1], full)
        check_block_cut(self.fp8, start, self.local, full, 1, "input")
        if rows.shape[1] > 1:  # block scales: this rank's columns
            rows = rows.narrow(1, start // self.fp8.block[1], self.scale.shape[2])
        return rows


class FusedMoE(nn.Module):
    """The sparse MLP block: `gate` (the router, [E, H]) and `experts` (stacked weights). Submodule
    names follow the checkpoints' (mlp.gate, mlp.experts.N.*). Its input is used twice (router and
    experts), so it takes no Deferred input; it all-reduces its own output. Expert parallel: the
    experts are this rank's block (`placement`), and `load` counts the tokens routed to each rank."""

    def takes_deferred(self, x: torch.Tensor) -> bool:
        return False

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 *, build: ModelBuild, prefix: str):
        super().__init__()
        tp_size = build.tp.size
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.placement = ExpertPlacement(build.tp.rank, tp_size, num_experts) \
            if build.expert_parallel and tp_size > 1 else None
        held, experts_tp = range(num_experts), build.tp
        if self.placement is not None:  # whole experts: no cut of the intermediate dimension
            self.load = ExpertLoad(self.placement)
            first = self.placement.first
            held, experts_tp = range(first, first + self.placement.per_rank), TensorParallel(0, 1)
        elif intermediate_size % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the experts' intermediate size "
                             f"{intermediate_size}")
        self.num_experts, self.top_k, self.renormalize, self.tp_size = num_experts, top_k, renormalize, tp_size
        self.rows_product, self.fixed_kernels = build.rows_product, build.fixed_kernels
        self.gate = ReplicatedLinear(hidden_size, num_experts, build=build, prefix=join(prefix, "gate"))
        # FP8 experts when the build's weight method for them is FP8 (a checkpoint format, or online)
        fp8 = getattr(build.linear_method(join(prefix, "experts")), "scheme", None)
        self.experts = nn.Module()
        self.experts.gate_up_proj = ExpertsGateUp(held, hidden_size, intermediate_size, tp=experts_tp, fp8=fp8)
        self.experts.down_proj = ExpertsDown(held, hidden_size, intermediate_size, tp=experts_tp, fp8=fp8)
        if tp_size > 1:
            self.all_reduce = AllReduce(hidden_size)

    def forward(self, x: torch.Tensor, reduce_later: bool = False) -> torch.Tensor:
        """reduce_later (the caller could take a PartialSum) is not taken up: the output is summed here.
        CUDA: the routing in one kernel; up to GEMV_MAX_TOKENS tokens, experts in the few-token
        kernels (kernels/moe_gemv.py), more in the grouped GEMMs (kernels/fused_moe.py)."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        w13, w2 = gate_up.weight, down.weight
        kernels = runs_kernels(x)
        if kernels:
            weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        skips = self.placement is not None
        if skips:  # this rank's pairs only: the others' expert ids become -1
            self.load.count(ids)
            ids = self.placement.local_ids(ids)
        # (fixed_kernels: one tile set at every number of tokens, a token's slots summed in order)
        fixed = dict(config=FIXED_TILES, ordered_sum=True) if self.fixed_kernels else {}
        if kernels and gate_up.scale is None and x.shape[0] <= GEMV_MAX_TOKENS and not fixed:
            out = moe_gemv(x, w13, w2, weights, ids)
        elif gate_up.scale is not None:  # FP8 experts, kept FP8 (CUDA)
            out = fused_moe(x, w13, w2, weights, ids, w13_scale=gate_up.scale, w2_scale=down.scale,
                            group_k13=gate_up.group_k, group_k2=down.group_k, skipped_pairs=skips, **fixed)
        elif kernels:
            out = fused_moe(x, w13, w2, weights, ids, skipped_pairs=skips, **fixed)
        else:
            out = fused_moe_torch(x, w13, w2, weights, ids, self.rows_product)
        if self.tp_size > 1:
            out = self.all_reduce(out)
        return out
