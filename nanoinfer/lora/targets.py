"""The projections an adapter may target (the seven of a dense decoder layer), their full,
unsharded shapes from the model config, and the fused layer of ours each one lives in (q/k/v in
qkv_proj, gate/up in gate_up_proj, from the model's packed_modules_mapping)."""
from collections.abc import Hashable

from transformers import PretrainedConfig

from nanoinfer.models.config_limits import head_dim

# checkpoint module (under model.layers.N.) -> its place
TARGET_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# our linear layers that take adapters (the last part of their module name)
LORA_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
DENSE_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


def check_lora_model(hf: PretrainedConfig):
    """enable_lora needs a dense decoder (MoE experts take no adapters here)."""
    archs = getattr(hf, "architectures", None) or []
    if not any(a in DENSE_ARCHITECTURES for a in archs):
        raise ValueError(f"enable_lora: adapters are supported for {', '.join(DENSE_ARCHITECTURES)}, "
                         f"not {archs!r}")


def target_shapes(hf: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """TARGET_MODULES -> (output features, input features) of the base weight."""
    hd, h, i = head_dim(hf), hf.hidden_size, hf.intermediate_size
    q, kv = hf.num_attention_heads * hd, hf.num_key_value_heads * hd
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def layer_shards(prefix: str, packed: dict) -> list[tuple[str, Hashable]] | None:
    """The checkpoint modules behind our linear layer `prefix` and their shard ids, in the fused
    layer's order ([("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")] for qkv_proj; [("o_proj",
    None)] for o_proj), or None for a layer that takes no adapter."""
    last = prefix.rpartition(".")[2]
    if last not in LORA_LAYERS or ".layers." not in f".{prefix}":
        return None
    fused = [(ckpt, shard) for ckpt, (ours, shard) in packed.items() if ours == last]
    return fused or [(last, None)]
