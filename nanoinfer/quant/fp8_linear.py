"""FP8 linear layers (vLLM's Fp8LinearMethod / CompressedTensorsW8A8Fp8): weights float8_e4m3fn
[N, K] with float32 scales [N, ceil(K / group_k)] (quant/fp8_scheme.py), loaded one checkpoint
tensor (shard) at a time.

- CPU: the weights are dequantized to the model's dtype once loaded and run as dense layers: CPU
  results are those of the dequantized model (the exactness reference). Activations are not
  quantized there.
- CUDA, one row (decode at batch 1): the FP8 GEMV (kernels/fp8_gemv.py) reads the FP8 weight and its
  scales, activations in the model's dtype, and can fuse the RMSNorm / SiLU * mul before it.
- CUDA, 2 to W8A16_MAX_ROWS rows (decode at small and mid batch): W8A16, the FP8 few-row GEMM
  (kernels/fp8_skinny_gemm.py): activations in the model's dtype, no quantization kernel before it.
- CUDA, more rows: W8A8. Activations are quantized per token (kernels/fp8_quant.py; static: the
  checkpoint's per-tensor input_scale); one scale column runs torch._scaled_mm with row-wise scales
  past SCALED_MM_MIN_ROWS rows (fewer rows: the Triton GEMM), block scales (per token and block_k
  group activations) the Triton block-scaled GEMM (kernels/fp8_gemm.py). W8A16 ignores a static
  input_scale: its activations are not rounded to FP8 at all.
Every step is shape-only (no host sync, no data-dependent allocation): CUDA graphs capture it."""
import torch
from torch import nn

from nanoinfer.kernels import fp8_prologue_quant, fp8_quant  # (looked up at call time: tests substitute them)
from nanoinfer.kernels.fp8_gemm import block_k_for, fp8_gemm
from nanoinfer.kernels.fp8_gemv import fp8_gemv, supports
from nanoinfer.kernels.fp8_skinny_gemm import fp8_skinny_gemm
from nanoinfer.layers.linear_method import (Deferred, LinearMethod, ShardSlice, linear, linear_parameter,
                                           load_feature_slice, takes_gemv)
from nanoinfer.quant import fp8_math
from nanoinfer.quant.fp8_scheme import FP8_DTYPE, Fp8Scheme
from nanoinfer.utils.loader import check_shape


def keeps_fp8(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on `device` (CUDA), else are dequantized at load (CPU)."""
    return device.type == "cuda"


# From 2 rows up to this many (the GEMV takes one), W8A16: the weight-streaming FP8 few-row GEMM on
# the activations as they are. W8A8 first quantizes them in a kernel of its own, which at these rows
# costs a launch-bound kernel per layer for no gain: the GEMM is bound by the weight's bytes
# (`python -m nanoinfer.bench.fp8 --w8a16` compares both paths per row count). Past 32 rows the
# wide projections (qkv, gate_up) ran slower than W8A8 on an H100: the 16-bit tile a program reads
# grows with the rows while the weight's bytes do not.
W8A16_MAX_ROWS = 32
# Weight shapes [N, K] whose W8A16 tiles (kernels/fp8_skinny_gemm.py TUNED) measured faster than W8A8
# up to more rows: the narrow ones (Qwen3-8B's o_proj and down_proj), where W8A8's few output tiles
# leave SMs idle.
W8A16_MAX_ROWS_BY_SHAPE = {(4096, 4096): 64, (4096, 12288): 64}
# Up to this many rows, W8A16 also applies the RMSNorm / SiLU * mul before it (a Deferred input):
# off (0) until the benchmark's fused rows show it pays (each program recomputes the rows' norm).
W8A16_PROLOGUE_MAX_ROWS = 0
# Up to this many rows the Triton W8A8 GEMM (narrow tiles that stream the weight) beats cuBLASLt's
# row-wise FP8 GEMM, which picks tiles made for large M (`python -m nanoinfer.bench.fp8`); W8A8 runs
# past W8A16_MAX_ROWS only.
SCALED_MM_MIN_ROWS = 64
# Past W8A16_MAX_ROWS rows up to this many, W8A8 with per-token (or per-group) dynamic activation
# scales takes the RMSNorm / SiLU * mul before it into its quantization kernel (kernels/fp8_prologue_quant.py). Off (0):
# that kernel walks a row in one program, which leaves most SMs idle at these row counts, and
# `bench.py --sweep --config 8b --quantization fp8` ran slower with it than with the separate norm
# and quantization kernels; raise it once the kernel splits a row across programs. (Since W8A16 takes
# the rows it was meant for, this path runs only past W8A16_MAX_ROWS, if at all.)
FUSED_QUANT_MAX_ROWS = 0


def takes_w8a16(x: torch.Tensor, out: torch.Tensor | None = None, weight_shape: tuple | None = None) -> bool:
    """Whether an FP8 layer (weights kept FP8, kernels_ok) multiplies input x by W8A16: 1 to
    W8A16_MAX_ROWS rows (W8A16_MAX_ROWS_BY_SHAPE's for a weight of that [N, K] shape; one contiguous
    row takes the GEMV before this is asked) with contiguous features in a 16-bit or float32 dtype,
    on a device that keeps FP8 weights; `out`, if given, of x's dtype."""
    top = W8A16_MAX_ROWS_BY_SHAPE.get(tuple(weight_shape), W8A16_MAX_ROWS) if weight_shape else W8A16_MAX_ROWS
    return (keeps_fp8(x.device) and x.dim() == 2 and 1 <= x.shape[0] <= top and x.stride(-1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and (out is None or out.dtype == x.dtype))


def scaled_mm_ok(device: torch.device, n: int, k: int) -> bool:
    """torch._scaled_mm with row-wise scales: Hopper or later (sm90+), N and K multiples of 16."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) and n % 16 == 0 \
        and k % 16 == 0


class Fp8LinearMethod(LinearMethod):
    """One instance per scheme, shared by the layers; per-layer state lives on the layer. A
    Deferred input (one row on CUDA) reaches the FP8 GEMV, which applies its pending step."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size, output_size, bias):
        s = self.scheme
        layer.compute_dtype = torch.get_default_dtype()  # build_model sets it to the model's dtype
        layer.fp8_group_k = fp8_math.group_k(s, input_size)
        layer.weight = linear_parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), 0, 1)
        layer.weight.dummy_std = 1.0  # load_format="dummy": N(0, 1) codes times a 0.02 scale
        scale = nn.Parameter(torch.empty(output_size, fp8_math.cdiv(input_size, layer.fp8_group_k),
                                         dtype=torch.float32), requires_grad=False)
        scale.from_checkpoint = not s.online  # online: computed while the weight loads
        scale.dummy_value = 0.02
        layer.register_parameter(s.scale_name, scale)
        if s.static_input:
            layer.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
            layer.input_scale.dummy_value = 1.0 / 16
            layer.input_scale_parts = {}  # shard id -> its scale, while the layer loads
        layer.register_parameter("bias", linear_parameter(torch.empty(output_size), 0, None) if bias else None)

    def load_weight(self, layer, param, loaded, where: ShardSlice):
        s = self.scheme
        if param is layer.weight:
            return self._load_fp8_weight(layer, loaded, where)
        if param is getattr(layer, s.scale_name):
            rows = fp8_math.scale_rows(s, loaded, where.out_full, where.in_full)
            fp8_math.check_block_cut(s, where.out_start, where.out_size, where.out_full, 0, "output")
            fp8_math.check_block_cut(s, where.in_start, where.in_size, where.in_full, 1, "input")
            rows = rows.narrow(0, where.out_start, where.out_size)
            if rows.shape[1] > 1:  # block scales: this rank's input features' columns
                rows = rows.narrow(1, where.in_start // s.block[1], param.shape[1])
            param.data.narrow(0, where.out_offset, where.out_size).copy_(rows)
            return
        if param is getattr(layer, "input_scale", None):
            if loaded.numel() != 1 or loaded.dim() > 1:
                raise ValueError(f"size mismatch: expected one per-tensor input_scale (shape [] or [1]), "
                                 f"found {list(loaded.shape)}")
            # one activation tensor feeds every shard of a fused layer (q/k/v, gate/up): the largest
            # scale fits them all (vLLM). Written at every shard, so the parameter holds what was
            # loaded when the loader checks it (never torch.empty's leftovers)
            layer.input_scale_parts[where.shard_id] = loaded.float().reshape(1)
            param.data.copy_(torch.stack(list(layer.input_scale_parts.values())).amax(0))
            return
        super().load_weight(layer, param, loaded, where)  # the bias

    def _load_fp8_weight(self, layer, loaded: torch.Tensor, where: ShardSlice):
        weight = layer.weight
        if self.scheme.online:
            if loaded.dtype == FP8_DTYPE:
                raise ValueError("quantization='fp8' quantizes a high-precision checkpoint; this tensor is "
                                 "already float8 (load the FP8 checkpoint without quantization=...)")
        elif loaded.dtype != FP8_DTYPE:
            raise ValueError(f"dtype {loaded.dtype}: the quantization_config makes this layer FP8, so a "
                             "float8_e4m3fn weight is expected (is the layer missing from its ignore list?)")
        fp8_math.check_block_cut(self.scheme, where.in_start, where.in_size, where.in_full, 1, "input")
        if not self.scheme.online:
            load_feature_slice(weight, loaded, where)
            return
        # online: quantize this rank's rows of the high-precision tensor, each row its own scale
        check_shape(loaded, (where.out_full, where.in_full))
        part = loaded.narrow(0, where.out_start, where.out_size).narrow(1, where.in_start, where.in_size)
        q, scale = fp8_math.quantize_rows(part.to(weight.device))
        weight.data.narrow(0, where.out_offset, where.out_size).copy_(q)
        getattr(layer, self.scheme.scale_name).data.narrow(0, where.out_offset, where.out_size).copy_(scale)

    def process_weights_after_loading(self, layer):
        s = self.scheme
        scale = getattr(layer, s.scale_name)
        if s.static_input:
            layer.input_scale_parts = {}
        if not keeps_fp8(layer.weight.device):
            # CPU: the dequantized model, as dense weights
            dense = fp8_math.dequantize(layer.weight.data, scale.data, layer.fp8_group_k, layer.compute_dtype)
            delattr(layer, s.scale_name)
            if s.static_input:
                delattr(layer, "input_scale")
            layer.weight = linear_parameter(dense, 0, 1)
            return
        # block sizes no kernel tiles (block_k without a power-of-two divisor >= 16): dequantize per call
        layer.fp8_kernels_ok = supports(scale, layer.fp8_group_k) and \
            block_k_for(layer.fp8_group_k, scale.shape[1]) is not None
        layer.use_scaled_mm = scale.shape[1] == 1 and scaled_mm_ok(layer.weight.device, *layer.weight.shape)
        if layer.use_scaled_mm:
            layer.weight_scale_row = scale.data.t()  # [1, N], as _scaled_mm's scale_b

    def apply(self, layer, x, bias=None, out=None):
        if layer.weight.dtype != FP8_DTYPE:  # dequantized (CPU)
            return linear(x, layer.weight, bias, out)
        scale = getattr(layer, self.scheme.scale_name)
        if not layer.fp8_kernels_ok:
            dense = fp8_math.dequantize(layer.weight, scale, layer.fp8_group_k, layer.compute_dtype)
            if isinstance(x, Deferred):
                return linear(x, dense.contiguous(), bias, out)
            return linear(x, dense, bias, out)
        if isinstance(x, Deferred) and takes_gemv(x.x):
            return fp8_gemv(x.x, layer.weight, scale, layer.fp8_group_k, bias, norm_weight=x.norm_weight, eps=x.eps,
                            residual=x.residual, residual_out=x.residual_out, silu_mul=x.silu_mul, out=out)
        if not isinstance(x, Deferred) and takes_gemv(x):
            return fp8_gemv(x, layer.weight, scale, layer.fp8_group_k, bias, out=out)
        if takes_w8a16(x.x if isinstance(x, Deferred) else x, out, layer.weight.shape):
            if isinstance(x, Deferred):
                return fp8_skinny_gemm(x.x, layer.weight, scale, layer.fp8_group_k, bias, norm_weight=x.norm_weight,
                                       eps=x.eps, residual=x.residual, residual_out=x.residual_out,
                                       silu_mul=x.silu_mul, out=out)
            return fp8_skinny_gemm(x, layer.weight, scale, layer.fp8_group_k, bias, out=out)
        y = self._w8a8(layer, x, scale)
        if bias is not None:
            y = y + bias
        if out is not None:
            return out.copy_(y)
        return y

    def takes_deferred(self, layer, x):
        return takes_gemv(x) or (x.dim() == 2 and x.shape[0] <= W8A16_PROLOGUE_MAX_ROWS and takes_w8a16(x, None, layer.weight.shape)
                                 and getattr(layer, "fp8_kernels_ok", False)) or self._quantizes_after(layer, x)

    def _quantizes_after(self, layer, x) -> bool:
        """Whether the W8A8 path takes x's pending step into its activation quantization."""
        return (x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= FUSED_QUANT_MAX_ROWS and x.stride(-1) == 1
                and not self.scheme.static_input and layer.weight.dtype == FP8_DTYPE
                and getattr(layer, "fp8_kernels_ok", False))

    def _w8a8(self, layer, x: "torch.Tensor | Deferred", scale: torch.Tensor) -> torch.Tensor:
        s, dtype = self.scheme, layer.compute_dtype
        gk = layer.fp8_group_k if scale.shape[1] > 1 else None
        if isinstance(x, Deferred):  # (_quantizes_after said yes)
            xq, x_scale = fp8_prologue_quant.quantize_fp8_after(
                x.x, norm_weight=x.norm_weight, eps=x.eps, residual=x.residual, residual_out=x.residual_out,
                silu_mul=x.silu_mul, group_k=gk)
            return self._product(layer, xq, x_scale, scale, dtype)
        x = x.reshape(-1, x.shape[-1])
        if s.static_input:
            xq = fp8_math.quantize_static(x, layer.input_scale)
            x_scale = layer.input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        else:
            xq, x_scale = fp8_quant.quantize_fp8(x if x.stride(-1) == 1 else x.contiguous(), gk)
        return self._product(layer, xq, x_scale, scale, dtype)

    @staticmethod
    def _product(layer, xq: torch.Tensor, x_scale: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
        if layer.use_scaled_mm and xq.shape[0] > SCALED_MM_MIN_ROWS:  # row-wise scales need a bf16 output
            # fast accumulation (no periodic promotion of the FP8 accumulator), as vLLM's CUTLASS
            # FP8 kernels for Hopper run: the tensor cores' full FP8 rate
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale_row,
                                 out_dtype=torch.bfloat16, use_fast_accum=True)
            return y if dtype == torch.bfloat16 else y.to(dtype)
        return fp8_gemm(xq, x_scale, layer.weight, scale, layer.fp8_group_k, dtype)
