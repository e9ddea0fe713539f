"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) and check it against
the base model: every tensor must be a lora_A / lora_B pair of one of the seven projections of a
decoder layer the model has, of the base's shapes, with a rank within max_lora_rank. Anything else
is a ValueError that names the file, the field or the tensor. Options that change the computation
beyond x @ A^T @ B^T * scale (DoRA and PEFT's other LoRA variants, LoRA biases, modules_to_save,
per-module alpha, layer replication) are refused rather than ignored."""
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from nanoinfer.lora.targets import TARGET_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names (base_model.model.model.layers.N.<module>.lora_A.weight), and the forms other tools
# write: without the PEFT prefix, over a base model saved without "model." (embedding models), or
# with PEFT's adapter name left in (lora_A.default.weight)
_TENSOR = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.([a-z_]+\.[a-z_]+)"
                     r"\.lora_([AB])(?:\.default)?\.weight")


@dataclass
class LoRAWeights:
    """One projection's adapter: a [r, in features], b [out features, r], scale (alpha / r, or
    alpha / sqrt(r) with rsLoRA)."""
    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class PeftAdapter:
    """modules: checkpoint module name ("model.layers.0.self_attn.q_proj") -> its weights."""
    path: str
    modules: dict[str, LoRAWeights]


@dataclass(frozen=True)
class AdapterLimits:
    """What an adapter is checked against: the base's projection shapes (target_shapes), its
    number of decoder layers, and max_lora_rank."""
    shapes: dict
    num_layers: int
    max_rank: int


def read_adapter_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    _check_options(config, file)
    return config


def _check_options(config: dict, file: str):
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{file}: peft_type {peft_type!r} is not supported (only 'LORA')")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{file}: r must be a positive int, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{file}: lora_alpha must be a finite number, got {alpha!r}")
    refused = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out weights",
               "modules_to_save": "modules_to_save", "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
               # PEFT's LoRA variants and options whose product is not x @ A^T @ B^T * scale, though
               # their tensors look like plain LoRA's: applied as plain LoRA they would differ silently
               "alora_invocation_tokens": "activated LoRA (aLoRA)", "layer_replication": "layer_replication",
               "arrow_config": "Arrow routing", "kasa_config": "KaSA", "velora_config": "VeLoRA",
               "monteclora_config": "MonteCLoRA", "use_bdlora": "block-diagonal LoRA", "use_qalora": "QALoRA"}
    for name, what in refused.items():
        if config.get(name):
            raise ValueError(f"{file}: {name}={config[name]!r}: {what} not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r} not supported (only 'none')")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{file}: use_rslora must be a bool, got {config['use_rslora']!r}")


def read_peft_adapter(path: str, limits: AdapterLimits, dtype: torch.dtype = torch.float32) -> PeftAdapter:
    """The adapter at `path`, checked against `limits`, its tensors in `dtype` on the host."""
    config = read_adapter_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                module, half = _parse_name(name, limits)
                if half in halves.get(module, {}):
                    raise ValueError(f"adapter tensor {name!r} names the same module and half as another tensor "
                                     f"of the file (lora_{half} of {module})")
                halves.setdefault(module, {})[half] = _checked_tensor(name, f.get_tensor(name))
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{file}: not a readable safetensors file: {e}") from None
    if not halves:
        raise ValueError(f"{file}: holds no LoRA tensors")
    modules = {module: _pair(module, pair, config, limits, dtype) for module, pair in halves.items()}
    return PeftAdapter(path, modules)


def _parse_name(name: str, limits: AdapterLimits) -> tuple[str, str]:
    """(checkpoint module name, "A" or "B") of an adapter tensor name."""
    m = _TENSOR.fullmatch(name)
    if m is None or m.group(2) not in TARGET_MODULES:
        raise ValueError(f"adapter tensor {name!r}: unsupported target module (LoRA applies to "
                         f"{', '.join(t.split('.')[1] for t in TARGET_MODULES)} of the decoder layers, "
                         "as base_model.model.model.layers.N.<module>.lora_A.weight / lora_B.weight)")
    if int(m.group(1)) >= limits.num_layers:
        raise ValueError(f"adapter tensor {name!r}: layer {m.group(1)} does not exist "
                         f"(the model has {limits.num_layers} layers)")
    return f"model.layers.{m.group(1)}.{m.group(2)}", m.group(3)


def _checked_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point or t.dim() != 2:
        raise ValueError(f"adapter tensor {name!r}: expected a 2-D floating-point tensor, "
                         f"got {t.dtype} of shape {list(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"adapter tensor {name!r} holds NaN or inf values")
    return t


def _pair(module: str, pair: dict, config: dict, limits: AdapterLimits, dtype: torch.dtype) -> LoRAWeights:
    name = f"base_model.model.{module}"
    for half in "AB":
        if half not in pair:
            raise ValueError(f"adapter tensor {name}.lora_{half}.weight is missing "
                             f"(its lora_{'B' if half == 'A' else 'A'} is there)")
    a, b = pair["A"], pair["B"]
    out_features, in_features = limits.shapes[module.split(".", 3)[3]]
    r = a.shape[0]
    if r > limits.max_rank:
        raise ValueError(f"adapter tensor {name}.lora_A.weight: rank {r} exceeds max_lora_rank={limits.max_rank}")
    if not config.get("rank_pattern") and r != config["r"]:
        raise ValueError(f"adapter tensor {name}.lora_A.weight: rank {r} differs from the config's r={config['r']}")
    for half, t, expected in (("A", a, [r, in_features]), ("B", b, [out_features, r])):
        if list(t.shape) != expected:
            raise ValueError(f"adapter tensor {name}.lora_{half}.weight: shape {list(t.shape)} does not match "
                             f"the base model's, expected {expected}")
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    return LoRAWeights(a.to(dtype), b.to(dtype), scale)
