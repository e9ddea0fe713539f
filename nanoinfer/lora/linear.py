"""The LoRA weight method: wraps a linear layer's own method (dense or quantized) and adds each
row's adapter, y = base(x) + (x @ A_s^T) @ (scale * B_s)^T for the row's slot s (none: nothing).

Per layer, the slots are stacked in two buffers (not parameters: the checkpoint has none):
`lora_a` [slots * shards * max_rank, in features] and `lora_b` [out features, slots * shards *
max_rank], where a fused layer (qkv: 3 shards, gate_up: 2) gives each shard its own rank block and
its B block sits at that shard's output rows, so one shrink and one expand serve the fused layer.
Slot s, shard j, rank k is row (s * shards + j) * max_rank + k of lora_a and that column of
lora_b; unused ranks are zero.

The shrink runs over every slot and its output is masked by each row's slot (a one-hot mask made
once per forward), then one expand: no host sync and no data-dependent shape, so CUDA graphs
capture it with the slots in a static buffer, each slot's weights are read once per step, and rows
of the base model get the layer's base product + exactly 0 (over a dense base that product is the
joint one below, whose GEMM may round differently from the base weight's alone: a base row's last
bits can depend on whether its step ran the adapters). The cost is the adapters' FLOPs times the number of
slots, small against the base product at decode. On CUDA the expand is one Triton kernel
(kernels/lora_expand.py) that multiplies only the slots a block of rows uses.

Over a dense base, `lora_a`'s rows sit right below the base weight's in one buffer, so one product
(GEMM, or at a few rows on CUDA the GEMV or the few-row GEMM, which also apply a Deferred input's
pending RMSNorm or SiLU * mul) computes the base
output and the shrink together: at decode, where each kernel costs more to run than its bytes, the
adapters then add one kernel per layer, the expand, which writes base + adapter into a contiguous
output. Over another base (FP8) the shrink is its own product.

Tensor parallelism: A is cut like the layer's input features and B like its output features (its
ShardSlice), so a row-parallel layer's partial product plus its partial LoRA product sum to the
whole under the same all-reduce."""
import os
from collections.abc import Hashable

import torch
from torch import nn

from nanoinfer.kernels.lora_expand import lora_expand
from nanoinfer.layers.linear_method import (Deferred, DenseLinearMethod, LinearMethod, fuses_prologue, linear,
                                             linear_parameter)
from nanoinfer.lora.targets import layer_shards
from nanoinfer.utils.context import Context, get_context

# the expand as one Triton kernel on CUDA (kernels/lora_expand.py); NANOINFER_LORA_TRITON=0: torch's
TRITON_EXPAND = os.environ.get("NANOINFER_LORA_TRITON", "1") != "0"


class LoRALinearMethod(LinearMethod):
    def __init__(self, base: LinearMethod, shards: list[tuple[str, Hashable]], num_slots: int, max_rank: int,
                 rows_product=None):
        """rows_product: as ModelBuild's, for the shrink and the expand (then never joint with the base's
        product, a separate add: a row's adapter term does not depend on the rows beside it)."""
        self.base, self.shards = base, shards
        self.num_slots, self.max_rank = num_slots, max_rank
        self.rows_product = rows_product

    def takes_deferred(self, layer, x) -> bool:
        """As the base method, and over a dense base also the joint product's kernel (the base
        weight with the shrink's rows below it): a Deferred input reaches the shrink's product too,
        which applies the pending RMSNorm or SiLU * mul itself."""
        return self.base.takes_deferred(layer, x) and (not self.fused or fuses_prologue(x, layer.weight_and_lora_a))

    @property
    def width(self) -> int:
        """Rank columns per slot."""
        return len(self.shards) * self.max_rank

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        self.base.create_weights(layer, input_size, output_size, bias)
        total = self.num_slots * self.width
        self.fused = type(self.base) is DenseLinearMethod
        if not self.fused:
            layer.register_buffer("lora_a", torch.zeros(total, input_size), persistent=False)
        else:  # the base weight and bias are views of the first output_size rows of the joint buffers
            layer.weight_and_lora_a = torch.zeros(output_size + total, input_size)
            layer.weight = linear_parameter(layer.weight_and_lora_a[:output_size], 0, 1)
            layer.register_buffer("lora_a", layer.weight_and_lora_a[output_size:], persistent=False)
            layer.bias_and_zeros = None
            if bias:
                layer.bias_and_zeros = torch.zeros(output_size + total)
                layer.bias = linear_parameter(layer.bias_and_zeros[:output_size], 0, None)
        layer.register_buffer("lora_b", torch.zeros(output_size, total), persistent=False)

    def load_weight(self, layer, param, loaded, where):
        self.base.load_weight(layer, param, loaded, where)

    def process_weights_after_loading(self, layer):
        self.base.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None, out=None):
        ctx = get_context()
        if ctx.lora_slots is None:
            return self.base.apply(layer, x, bias, out)
        if not self.fused:
            return self.add_adapters(layer, x, self.base.apply(layer, x, bias, out), None, ctx, out)
        n = layer.weight.shape[0]
        both = linear(x, layer.weight_and_lora_a, None if bias is None else layer.bias_and_zeros)
        return self.add_adapters(layer, x, both[:, :n], both[:, n:], ctx, out)

    def add_adapters(self, layer, x: "torch.Tensor | Deferred", y: torch.Tensor, shrunk: torch.Tensor | None,
                     ctx: Context, out: torch.Tensor | None = None) -> torch.Tensor:
        """y + each row's adapter product: the shrink over every slot (unless given: computed with
        y), then the expand of each row's slot (ctx.lora_slots), the Triton kernel on CUDA, else a
        mask and an addmm. Written into `out` if given, else into y when y is contiguous (a new
        tensor otherwise)."""
        if self.rows_product is not None:
            return self.add_adapters_by_rows(layer, x, y, ctx, out)
        if shrunk is None:  # (a Deferred input: the fused kernel again; it rewrites the residual alike)
            shrunk = linear(x, layer.lora_a)
        if out is None:
            out = y if y.is_contiguous() else torch.empty(y.shape, dtype=y.dtype, device=y.device)
        if expand_kernel_for(y):
            return lora_expand(shrunk, layer.lora_b, ctx.lora_slots, y, self.num_slots, out=out)
        if ctx.lora_mask is None:  # the forward's first LoRA layer (inside a CUDA graph: captured too)
            ctx.lora_mask = slot_mask(ctx.lora_slots, self.num_slots, shrunk.dtype)
        shrunk = shrunk * ctx.lora_mask.repeat_interleave(self.width, 1)
        if out is y:
            return y.addmm_(shrunk, layer.lora_b.t())
        return torch.addmm(y, shrunk, layer.lora_b.t(), out=out)

    def add_adapters_by_rows(self, layer, x: torch.Tensor, y: torch.Tensor, ctx: Context,
                             out: torch.Tensor | None) -> torch.Tensor:
        """add_adapters with the shrink and the expand taken through rows_product."""
        if ctx.lora_mask is None:
            ctx.lora_mask = slot_mask(ctx.lora_slots, self.num_slots, y.dtype)
        shrunk = self.rows_product(lambda rows: linear(rows, layer.lora_a), x)
        shrunk = shrunk * ctx.lora_mask.repeat_interleave(self.width, 1)
        total = y + self.rows_product(lambda rows: linear(rows, layer.lora_b), shrunk)
        return total if out is None else out.copy_(total)

    # ---- slots ----------------------------------------------------------------------------------
    def clear_slot(self, layer, slot: int):
        cols = slice(slot * self.width, (slot + 1) * self.width)
        layer.lora_a[cols].zero_()
        layer.lora_b[:, cols].zero_()

    def write_shard(self, layer, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor, scale: float):
        """This rank's share of one shard's adapter (full a [r, in], b [out, r]) into `slot`."""
        where = layer.shard_slice(self.shards[shard][1])
        r, start = a.shape[0], (slot * len(self.shards) + shard) * self.max_rank
        layer.lora_a[start:start + r].copy_(a[:, where.in_start:where.in_start + where.in_size], non_blocking=True)
        b = b[where.out_start:where.out_start + where.out_size] * scale
        layer.lora_b[where.out_offset:where.out_offset + where.out_size, start:start + r].copy_(b, non_blocking=True)


def expand_kernel_for(y: torch.Tensor) -> bool:
    """Whether the expand into `y` runs as the Triton kernel: on CUDA, unless turned off."""
    return TRITON_EXPAND and y.is_cuda and y.stride(1) == 1


def slot_mask(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, num_slots] in `dtype`: 1 at each row's slot, 0 elsewhere (all 0 for slot -1)."""
    return (slots[:, None] == torch.arange(num_slots, device=slots.device)).to(dtype)


def lora_method_chooser(choose, packed: dict, num_slots: int, max_rank: int, rows_product=None):
    """ModelBuild.linear_method with adapters on the seven projections: `choose`'s method, wrapped."""
    def choose_with_lora(prefix: str) -> LinearMethod:
        base, shards = choose(prefix), layer_shards(prefix, packed)
        return base if shards is None else LoRALinearMethod(base, shards, num_slots, max_rank, rows_product)
    return choose_with_lora
