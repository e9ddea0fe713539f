"""Tensor-parallel linear layers. Each holds only its rank's shard; `weight_loader` checks the full
checkpoint tensor's shape, then cuts the shard out of it. With one rank they are plain linear layers.
Fused layers declare their shards in `param.shard_ids` (see utils/loader.py). Every product goes
through `linear`: one-row inputs on CUDA take the GEMV kernel (kernels/gemv.py), which can also
apply the RMSNorm or SiLU * mul before it (Deferred)."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels.gemv import gemv
from nanoinfer.layers.all_reduce import AllReduce, PartialSum
from nanoinfer.utils.loader import check_shape


def takes_gemv(x: torch.Tensor) -> bool:
    """One contiguous row on CUDA (decode at batch 1): linear layers use kernels/gemv.py, measured
    faster than cuBLAS there, and can fuse the elementwise step before them (Deferred)."""
    return x.is_cuda and x.shape[0] == 1 and x.is_contiguous()


@dataclass
class Deferred:
    """A linear layer's input whose last elementwise step, RMSNorm (with the residual add) or
    SiLU * mul, is left to the layer's GEMV, which applies it while loading: one kernel fewer per
    use at batch 1. Made by RMSNorm / SiluAndMul(defer=True), for takes_gemv inputs only. For
    silu_mul, `x` is [1, 2K] (gate, up); with a residual, the GEMV stores x + residual into
    `residual_out`, which the norm has already returned as the new residual."""
    x: torch.Tensor
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    silu_mul: bool = False


def linear(x: "torch.Tensor | Deferred", weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias): the GEMV kernel for one row on CUDA, else F.linear. `out` (no bias):
    a contiguous [rows, out features] tensor to write the product into, which is returned."""
    if isinstance(x, Deferred):
        return gemv(x.x, weight, bias, norm_weight=x.norm_weight, eps=x.eps, residual=x.residual,
                    residual_out=x.residual_out, silu_mul=x.silu_mul, out=out)
    if takes_gemv(x) and weight.is_contiguous():
        return gemv(x, weight, bias, out=out)
    if out is not None:
        if bias is not None:
            raise ValueError("linear: out= takes no bias")
        return torch.mm(x, weight.t(), out=out)
    return F.linear(x, weight, bias)


_TP_OVERRIDE: tuple[int, int] | None = None


@contextmanager
def tp_shard(rank: int, size: int):
    """Build layers for this (rank, size) whatever torch.distributed says: a tp=1 engine built in
    a process where the user initialized torch.distributed must not shard."""
    global _TP_OVERRIDE
    previous, _TP_OVERRIDE = _TP_OVERRIDE, (rank, size)
    try:
        yield
    finally:
        _TP_OVERRIDE = previous


def tp_rank_and_size() -> tuple[int, int]:
    if _TP_OVERRIDE is not None:
        return _TP_OVERRIDE
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def full_shape(self, param: nn.Parameter) -> list[int]:
        """The checkpoint's (unsharded) shape of `param`: the split dimension times the ranks."""
        shape = list(param.shape)
        if self.tp_dim is not None and self.tp_dim < param.dim():  # a row-parallel bias is not split
            shape[self.tp_dim] *= self.tp_size
        return shape

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, self.full_shape(param))
        if self.tp_dim == 0:  # column parallel: weight rows and bias are both split
            size = param.shape[0]
            loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.copy_(loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp_size = tp_rank_and_size()[1]
        super().__init__(input_size, output_size // tp_size, bias, 0)

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate_up); shard_id indexes output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        for param in self.parameters():
            param.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param, loaded, shard_id: int):
        check_shape(loaded, [self.output_sizes[shard_id], *param.shape[1:]])
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are split across ranks, or replicated when there are fewer
    KV heads than ranks (each rank then keeps the KV head its query heads attend to)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = tp_rank_and_size()[1]
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        LinearBase.__init__(self, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, 0)
        for param in self.parameters():
            param.shard_ids = ("q", "k", "v")

    def weight_loader(self, param, loaded, shard_id: str):
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(loaded, [heads * self.head_dim, *param.shape[1:]])
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.tp_rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.
    The bias is added once, after the reduction. A caller whose next step is an RMSNorm may ask
    for the sum to be left to it (reduce_later): the product is then written into the all-reduce's
    symmetric buffer and returned as a PartialSum, where the fused kernel applies (layers/all_reduce.py)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp_size = tp_rank_and_size()[1]
        super().__init__(input_size // tp_size, output_size, bias, 1)
        if tp_size > 1:
            self.all_reduce = AllReduce(output_size)

    def weight_loader(self, param, loaded):
        check_shape(loaded, self.full_shape(param))
        if param.dim() == 2:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        param.data.copy_(loaded)

    def forward(self, x, reduce_later: bool = False):
        if self.tp_size > 1 and reduce_later and self.bias is None:
            rows = (x.x if isinstance(x, Deferred) else x).shape[0]
            buffer = self.all_reduce.partial_buffer(rows)
            if buffer is not None:
                return PartialSum(linear(x, self.weight, out=buffer), self.all_reduce)
        y = linear(x, self.weight)
        if self.tp_size > 1:
            y = self.all_reduce(y)
        return y if self.bias is None else y + self.bias
