"""Tensor-parallel linear layers. Each holds only its rank's shard and knows which share of a
checkpoint tensor that is (`shard_slice`); its weight method (layers/linear_method.py), chosen by the
build for the layer's module name (`prefix`), does the rest. Fused layers declare their shards in
`param.shard_ids` (see utils/loader.py)."""
from collections.abc import Hashable

import torch
from torch import nn

from nanoinfer.layers.all_reduce import AllReduce, PartialSum
from nanoinfer.layers.linear_method import Deferred, ShardSlice
from nanoinfer.layers.model_build import ModelBuild


class LinearBase(nn.Module):
    """in_features, out_features: this rank's shard. The method registers the weights and `bias`
    (a parameter or None)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, build: ModelBuild, prefix: str,
                 shard_ids: tuple | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.prefix = build.tp, prefix
        self.method = build.linear_method(prefix)
        self.method.create_weights(self, in_features, out_features, bias)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # (a method may load a parameter its own way)
                param.weight_loader = self.weight_loader
            if shard_ids is not None:
                param.shard_ids = shard_ids

    def takes_deferred(self, x: torch.Tensor) -> bool:
        """Whether forward takes a Deferred of input x (its method fuses the step before it)."""
        return self.method.takes_deferred(self, x)

    def shard_slice(self, shard_id: Hashable) -> ShardSlice:
        """Where checkpoint tensor `shard_id` of this layer goes on this rank. Default: replicated."""
        return ShardSlice(self.out_features, 0, self.out_features, 0, self.in_features, 0, self.in_features)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None):
        self.method.load_weight(self, param, loaded, self.shard_slice(shard_id))

    def forward(self, x: "torch.Tensor | Deferred") -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


class MergedColumnParallelLinear(LinearBase):
    """Several projections in one matmul (gate_up), each one's output features split across ranks;
    shard_id indexes output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *, build: ModelBuild,
                 prefix: str):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes) // build.tp.size, bias, build=build, prefix=prefix,
                         shard_ids=tuple(range(len(output_sizes))))

    def shard_slice(self, shard_id: int):
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        return ShardSlice(self.output_sizes[shard_id], self.tp.rank * size, size, offset,
                          self.in_features, 0, self.in_features, shard_id)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection, column parallel. KV heads are split across ranks, or replicated when
    there are fewer KV heads than ranks (each rank then keeps the KV head its query heads attend to)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 build: ModelBuild, prefix: str):
        tp_size = build.tp.size
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, build=build,
                         prefix=prefix, shard_ids=("q", "k", "v"))

    def shard_slice(self, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            full, offset, size, start = self.total_num_heads * self.head_dim, 0, q_size, self.tp.rank * q_size
        else:
            full, size = self.total_num_kv_heads * self.head_dim, kv_size
            offset = q_size if shard_id == "k" else q_size + kv_size
            start = (self.tp.rank // self.kv_replicas) * kv_size
        return ShardSlice(full, start, size, offset, self.in_features, 0, self.in_features, shard_id)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce, then the
    bias added once. A caller whose next step is an RMSNorm may leave the sum to it (reduce_later):
    the product is then returned as a PartialSum in the all-reduce's symmetric buffer, where the
    fused kernel applies (layers/fused_norm.py)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, build: ModelBuild, prefix: str):
        super().__init__(input_size // build.tp.size, output_size, bias, build=build, prefix=prefix)
        if self.tp.size > 1:
            self.all_reduce = AllReduce(output_size)

    def shard_slice(self, shard_id):
        n = self.in_features
        return ShardSlice(self.out_features, 0, self.out_features, 0, n * self.tp.size, self.tp.rank * n, n)

    def forward(self, x: "torch.Tensor | Deferred", reduce_later: bool = False) -> "torch.Tensor | PartialSum":
        if self.tp.size > 1 and reduce_later and self.bias is None:
            rows = x.rows if isinstance(x, Deferred) else x.shape[0]
            buffer = self.all_reduce.partial_buffer(rows)
            if buffer is not None:
                return PartialSum(self.method.apply(self, x, out=buffer), self.all_reduce)
        y = self.method.apply(self, x)
        if self.tp.size > 1:
            y = self.all_reduce(y)
        return y if self.bias is None else y + self.bias
