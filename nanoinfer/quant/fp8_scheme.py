"""Which FP8 weight format a model uses, read once from the engine options and the checkpoint's
`quantization_config` (vLLM's names), and which layers it leaves unquantized.

Every format is held the same way once loaded: a float8_e4m3fn weight [N, K] and float32 scales
[N, ceil(K / group_k)], one row of scales per output feature (quant/fp8_math.py). Block scales are
repeated over the rows of their block at load time, so a fused layer's shards (q/k/v, gate/up) and a
tensor-parallel cut need no block alignment along the output features; per-channel and per-tensor
scales are blocks of one row or of the whole tensor, with one scale column (group_k = K)."""
import re
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


@dataclass(frozen=True)
class Fp8Scheme:
    """strategy: "block" (one scale per block_n x block_k weights), "channel" (per output feature)
    or "tensor" (per checkpoint tensor); scale_name: the checkpoint's name of the weight scales
    ("weight_scale_inv" for block FP8, else "weight_scale"); static_input: the checkpoint holds a
    per-tensor `input_scale` (else activations are scaled per token, or per token and block_k
    group for block weights); online: weights come in high precision and are quantized per output
    channel while they load; ignore / ignore_is_exact: the checkpoint module names left dense
    (compressed-tensors: exact names or "re:" regexes; fp8: substrings of the name, as vLLM)."""
    strategy: str
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    static_input: bool = False
    online: bool = False
    ignore: tuple[str, ...] = ()
    ignore_is_exact: bool = False

    def is_ignored(self, name: str) -> bool:
        if self.ignore_is_exact:
            return any(re.match(p[3:], name) is not None if p.startswith("re:") else p == name for p in self.ignore)
        return any(p in name for p in self.ignore)


def _positive_block(block) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"quantization_config: weight_block_size must be two positive ints [block_n, block_k], "
                         f"got {block!r}")
    return int(block[0]), int(block[1])


def _fp8_method(qc: dict) -> Fp8Scheme:
    """vLLM's Fp8Config: `weight_block_size` -> block scales `weight_scale_inv` (dynamic activations
    only); without it, one `weight_scale` per tensor and `input_scale` when activations are static."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fmt must be 'e4m3' (float8_e4m3fn), got {fmt!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config: activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("tensor", static_input=scheme == "static", ignore=ignore)
    if scheme != "dynamic":
        raise ValueError("quantization_config: block-wise FP8 (weight_block_size) takes activation_scheme "
                         f"'dynamic', got {scheme!r}")
    return Fp8Scheme("block", _positive_block(block), "weight_scale_inv", ignore=ignore)


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    """compressed-tensors (llm-compressor, RedHatAI's FP8 and FP8-dynamic): every config group must be
    the same FP8 scheme for Linear layers: 8-bit float weights, symmetric, static, per channel, tensor or
    block; activations absent (weight-only), dynamic per token, or static per tensor."""
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not supported; "
                         "'float-quantized' (FP8) is")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config: compressed-tensors needs a non-empty config_groups")
    schemes = set()
    for name, group in groups.items():
        targets = group.get("targets") or []
        if "Linear" not in targets:
            raise ValueError(f"quantization_config: config_groups.{name}.targets must include 'Linear', "
                             f"got {targets!r}")
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float" or not w.get("symmetric", True) or w.get("dynamic"):
            raise ValueError(f"quantization_config: config_groups.{name}.weights must be static symmetric 8-bit "
                             f"float (FP8), got {w!r}")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"quantization_config: config_groups.{name}.weights.strategy must be 'channel', "
                             f"'tensor' or 'block', got {strategy!r}")
        block = _positive_block(w.get("block_structure")) if strategy == "block" else None
        a = group.get("input_activations")
        static = False
        if a is not None:
            if a.get("num_bits") != 8 or a.get("type") != "float":
                raise ValueError(f"quantization_config: config_groups.{name}.input_activations must be 8-bit "
                                 f"float (FP8), got {a!r}")
            if a.get("dynamic"):
                if a.get("strategy", "token") not in ("token", "tensor"):
                    raise ValueError(f"quantization_config: config_groups.{name}.input_activations.strategy must "
                                     f"be 'token' or 'tensor' when dynamic, got {a.get('strategy')!r}")
            elif a.get("strategy", "tensor") == "tensor":
                static = True
            else:
                raise ValueError(f"quantization_config: config_groups.{name}.input_activations: static scales "
                                 f"must be per tensor, got strategy {a.get('strategy')!r}")
        schemes.add((strategy, block, static))
    if len(schemes) != 1:
        raise ValueError(f"quantization_config: config_groups use several schemes {sorted(map(str, schemes))}; "
                         "one FP8 scheme for every Linear layer is supported")
    strategy, block, static = schemes.pop()
    return Fp8Scheme(strategy, block, "weight_scale", static, ignore=tuple(qc.get("ignore") or ()),
                     ignore_is_exact=True)


def fp8_scheme(quantization: str | None, hf_config) -> Fp8Scheme | None:
    """The model's FP8 scheme: the checkpoint's quantization_config if it has one, else online
    per-channel FP8 for quantization="fp8", else None (dense)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if not qc:
        return Fp8Scheme("channel", online=True) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_method(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; 'fp8' (block or per-tensor "
                     "FP8) and 'compressed-tensors' (FP8) are")
