"""Load safetensors checkpoints into our (fused, tensor-parallel) parameters.

Every checkpoint tensor goes to one parameter, through the parameter's `weight_loader(param, tensor)`
or, for a fused parameter, `weight_loader(param, tensor, shard_id)`. A model's
`packed_modules_mapping` maps a checkpoint name part to (our parameter name part, shard id), for
example `"q_proj": ("qkv_proj", "q")` or, for experts stacked into one parameter,
`"experts.3.gate_proj": ("experts.gate_up_proj", (3, 0))`. Shard ids are any hashable values.

Nothing loads silently wrong:
- A fused parameter declares the shards it expects as `param.shard_ids` (QKV: ("q", "k", "v"),
  gate_up: (0, 1), stacked experts: every (expert, shard) tuple); a plain parameter expects one
  unnamed load. A parameter's `held_elsewhere(shard_id)` (expert parallel: another rank's
  experts) makes the loader skip that tensor without reading it. Every declared shard of every
  parameter must be loaded exactly once, else a ValueError names the missing (or repeated)
  checkpoint tensor.
- Weight loaders compare the full, unsharded checkpoint tensor's shape with the one the config
  implies (`check_shape`) before cutting their tensor-parallel shard out of it, and raise a
  ValueError, which `load_model` prefixes with the checkpoint tensor's name.
- An integer or bool tensor for a float parameter is refused (`check_dtype`), and so is a NaN or an
  inf in any loaded float parameter (`check_finite`, on the device, one host sync per model).
- An FP8 tensor for a parameter that is not FP8 is refused (its scales would be lost); a quantized
  layer's method checks its own tensors (quant/). Parameters marked `from_checkpoint = False` (online
  FP8 scales) are made while loading, not read.
- A checkpoint's FP8 KV-cache scales (`self_attn.k_proj.k_scale`, `self_attn.k_scale`, v alike) go to
  the Attention layer's `self_attn.attn.k_scale` / `v_scale` when the model has them; without them
  they are skipped for kv_cache_dtype="auto", as vLLM does.
"""
import glob
import json
import logging
import os
from collections.abc import Hashable, Sequence

import torch
from safetensors import safe_open
from torch import nn


def check_shape(loaded: torch.Tensor, expected: Sequence[int]):
    """Refuse a tensor whose shape is not `expected` (the full, unsharded shape): copy_ would
    broadcast a smaller one and narrow would silently cut a larger one."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"size mismatch: expected shape {list(expected)} (full, unsharded), "
                         f"found {list(loaded.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def _rename(name: str, old: str, new: str) -> str:
    return name.replace(f".{old}.", f".{new}.", 1)


def checkpoint_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: those its model.safetensors.index.json lists when it has
    one (as HF and vLLM read it: Mistral repos also hold a consolidated.safetensors in another naming),
    else every *.safetensors."""
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    index = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index):
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        return files
    try:
        with open(index) as f:
            listed = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {e!r}") from None
    absent = sorted(str(name) for name in listed if not os.path.isfile(os.path.join(path, str(name))))
    if absent or not listed:
        raise ValueError(f"{index} lists shard(s) {absent[:3]} that {path!r} lacks" if absent else
                         f"{index}: its weight_map is empty")
    skipped = sorted(os.path.basename(f) for f in files if os.path.basename(f) not in listed)
    if skipped:
        logging.getLogger(__name__).warning("%s: not reading %s, which %s does not list", path, skipped, INDEX_FILE)
    return sorted(os.path.join(path, name) for name in listed)


INDEX_FILE = "model.safetensors.index.json"


def load_model(model: nn.Module, path: str, kv_cache_dtype: str = "auto"):
    files = checkpoint_files(path)
    packed = getattr(model, "packed_modules_mapping", {})
    prefixes = getattr(model, "checkpoint_prefixes", {})  # another layout's name prefix -> ours
    tied = getattr(model, "tie_word_embeddings", False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[int, Hashable]] = set()  # (id(param), shard id or None); tied names share one param
    sources: dict[int, list[tuple[str, str]]] = {}  # id(param) -> the (checkpoint tensor, file)s loaded into it
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            prefix = _base_model_prefix(model, f.keys())
            for stored in f.keys():
                name = _renamed_prefix(prefix + stored, prefixes)
                if tied and name == "lm_head.weight":
                    continue  # tied: the embedding is the head
                kv_scale = _kv_scale_target(name)
                if kv_scale is not None and kv_scale not in params:
                    if kv_cache_dtype == "auto":
                        continue  # a checkpoint's FP8 KV-cache scale, unused by a model-dtype cache
                    raise ValueError(f"checkpoint tensor {name!r}: kv_cache_dtype={kv_cache_dtype!r} needs "
                                     f"parameter {kv_scale!r}, which {type(model).__name__} lacks")
                target, shard = kv_scale or name, None
                for ckpt_key, (ours, shard_id) in packed.items():
                    if kv_scale is None and f".{ckpt_key}." in name:
                        target, shard = _rename(name, ckpt_key, ours), shard_id
                        break
                param = params.get(target)
                if param is None:
                    if "rotary_emb.inv_freq" in name:
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
                held_elsewhere = getattr(param, "held_elsewhere", None)
                if held_elsewhere is not None and held_elsewhere(shard):
                    continue  # another rank's part (expert parallel: its experts): never read here
                if shard not in getattr(param, "shard_ids", (None,)):
                    raise ValueError(f"checkpoint tensor {name!r} maps to shard {shard!r} of {target!r}, which "
                                     f"expects shards {getattr(param, 'shard_ids', None)!r}")
                if (id(param), shard) in loaded:
                    raise ValueError(f"checkpoint tensor {name!r} appears more than once in {path!r}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                tensor = f.get_tensor(stored)
                try:
                    check_dtype(tensor, param)
                    loader(param, tensor) if shard is None else loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r} in {file!r}: {e}") from e
                loaded.add((id(param), shard))
                sources.setdefault(id(param), []).append((stored, file))
    missing = [_checkpoint_name(name, shard, packed)
               for name, param in model.named_parameters()  # tied parameters once, under the embedding's name
               if not getattr(param, "optional_in_checkpoint", False)  # e.g. KV cache scales (default 1.0)
               if getattr(param, "from_checkpoint", True)  # (e.g. online FP8 scales, made while loading)
               for shard in getattr(param, "shard_ids", (None,)) if (id(param), shard) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks tensor(s) {missing[:5]}{'...' if len(missing) > 5 else ''}")
    check_finite(model, sources)


def _base_model_prefix(model: nn.Module, names) -> str:
    """"model." for a file of a base model's weights (saved without the causal-LM wrapper, as
    embedding checkpoints such as Qwen3-Embedding are: `layers.0...`, `embed_tokens.weight`) read
    into our `model.`-rooted model; else ""."""
    names = list(names)
    if not isinstance(getattr(model, "model", None), nn.Module) or not names:
        return ""
    return "" if any(n.startswith(("model.", "lm_head.")) for n in names) else "model."


def check_dtype(loaded: torch.Tensor, param: nn.Parameter):
    """Refuse an integer or bool tensor for a float parameter (copy_ would cast it); float-to-float
    (a bf16 checkpoint into float32, fp16 into bf16) is a rounding, as in every engine."""
    if param.dtype.is_floating_point and not loaded.dtype.is_floating_point:
        raise ValueError(f"dtype {loaded.dtype} cannot load into a {param.dtype} parameter: a floating-point "
                         "tensor (float32, bfloat16, float16, ...) is expected")
    if loaded.dtype in _FP8_DTYPES and param.dtype not in _FP8_DTYPES:
        raise ValueError(f"dtype {loaded.dtype} cannot load into a {param.dtype} parameter: FP8 weights need "
                         "their scales, and this layer is not quantized (no quantization_config in config.json, "
                         "or the layer is in its ignore list)")


@torch.no_grad()
def check_finite(model: nn.Module, sources: dict[int, list[tuple[str, str]]]):
    """Refuse NaN or inf in any float parameter once loaded: one isfinite per parameter on its device
    and one host sync for the whole model. Only then, to name the culprit, the checkpoint tensors of
    the first bad parameter are read again on the host (a value finite in the checkpoint can also
    overflow the model's dtype, e.g. 1e5 in float16)."""
    named = [(name, p) for name, p in model.named_parameters() if p.dtype.is_floating_point and p.numel()]
    if not named:
        return
    finite = torch.stack([_all_finite(p).to(named[0][1].device) for _, p in named])
    if bool(finite.all()):
        return
    name, param = named[finite.tolist().index(False)]
    for ckpt_name, file in sources.get(id(param), []):
        with safe_open(file, "pt", "cpu") as f:
            tensor = f.get_tensor(ckpt_name)
        if not bool(_all_finite(tensor)):
            raise ValueError(f"checkpoint tensor {ckpt_name!r} in {file!r} holds NaN or inf values")
        if tensor.dtype.is_floating_point and not bool(_all_finite(tensor.to(param.dtype))):
            raise ValueError(f"checkpoint tensor {ckpt_name!r} in {file!r} holds values outside the range of "
                             f"{param.dtype} (finite range ±{torch.finfo(param.dtype).max:.4g}): inf once loaded")
    raise ValueError(f"parameter {name!r} holds NaN or inf values after loading")


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_KV_SCALES = {".k_proj.k_scale": ".attn.k_scale", ".v_proj.v_scale": ".attn.v_scale",
              ".self_attn.k_scale": ".self_attn.attn.k_scale", ".self_attn.v_scale": ".self_attn.attn.v_scale"}


def _kv_scale_target(name: str) -> str | None:
    """The Attention layer's parameter for a checkpoint's FP8 KV-cache scale: compressed-tensors'
    `...self_attn.k_proj.k_scale` and the older `...self_attn.k_scale` (v the same) both go to
    `...self_attn.attn.k_scale`; None for any other tensor."""
    for suffix, ours in _KV_SCALES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ours
    return None


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """isfinite(t).all(), also for float8 (which torch's isfinite lacks): e4m3fn has no inf, and its NaN
    is every exponent and mantissa bit set; e5m2's inf/NaN have every exponent bit set."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if t.dtype == torch.float8_e5m2:
        return ((t.view(torch.uint8) & 0x7C) != 0x7C).all()
    return torch.isfinite(t).all()


def _renamed_prefix(name: str, prefixes: dict[str, str]) -> str:
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _checkpoint_name(name: str, shard: Hashable, packed: dict) -> str:
    """The checkpoint tensor that should have filled shard `shard` of our parameter `name`."""
    if shard is not None:
        for ckpt_key, (ours, shard_id) in packed.items():
            if shard_id == shard and f".{ours}." in name:
                return _rename(name, ours, ckpt_key)
    return name


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int):
    """Random weights for throughput runs: matrices ~ N(0, 0.02), norms 1, biases 0, the same on every
    run (each rank draws its own shard from a seeded generator on its device)."""
    gen = None
    for name, param in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        if hasattr(param, "dummy_value"):  # a quantized layer's scales
            param.fill_(param.dummy_value)
        elif param.dtype in _FP8_DTYPES:  # FP8 codes, N(0, dummy_std), drawn in bfloat16
            noise = torch.empty(param.shape, dtype=torch.bfloat16, device=param.device)
            noise.normal_(0.0, getattr(param, "dummy_std", 1.0), generator=gen)
            param.copy_(noise.clamp_(-torch.finfo(param.dtype).max, torch.finfo(param.dtype).max))
        elif param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
