"""Load safetensors checkpoints into our (fused, tensor-parallel) parameters."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_names = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if getattr(model, "tie_word_embeddings", False) and name == "lm_head.weight":
                    continue  # tied: the embedding is the head
                target, shard = name, None
                for ckpt_key, (ours, shard_id) in packed.items():
                    if f".{ckpt_key}." in name:
                        target, shard = name.replace(ckpt_key, ours), shard_id
                        break
                param = params.get(target)
                if param is None:
                    if "rotary_emb.inv_freq" in name:
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                tensor = f.get_tensor(name)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
                loaded_names.add(target)
    missing = [n for n in params if n not in loaded_names
               and not (n == "lm_head.weight" and getattr(model, "tie_word_embeddings", False))]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int):
    """Random weights for throughput runs: matrices ~ N(0, 0.02), norms 1, biases 0, the same on every
    run (each rank draws its own shard from a seeded generator on its device)."""
    gen = None
    for name, param in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
