"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse MLP (router + experts) in the layers HF
makes sparse: not in `mlp_only_layers` and (layer + 1) % `decoder_sparse_step` == 0; the others keep
a dense MLP of `intermediate_size`. Routing renormalises the top-k weights when `norm_topk_prob`.

The checkpoint stores each expert's projections (mlp.experts.N.gate_proj/up_proj/down_proj); the
loader stacks them into FusedMoE's [E, 2I, H] and [E, H, I] through per-expert entries of
`packed_modules_mapping`, built from the config (they come before the dense gate_proj/up_proj
entries, which would also match an expert's name)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP


def expert_mapping(num_experts: int, gate: str, up: str, down: str, ckpt: str = "experts",
                   ours: str = "experts") -> dict:
    """Checkpoint name of each expert's projection (f"{ckpt}.{e}.{gate}") -> (our stacked parameter,
    shard id). The loader replaces the matched part of the name only."""
    mapping = {}
    for e in range(num_experts):
        mapping[f"{ckpt}.{e}.{gate}"] = (f"{ours}.gate_up_proj", (e, 0))
        mapping[f"{ckpt}.{e}.{up}"] = (f"{ours}.gate_up_proj", (e, 1))
        mapping[f"{ckpt}.{e}.{down}"] = (f"{ours}.down_proj", e)
    return mapping


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3's model, each layer's MLP sparse or dense (`make_mlp`)."""
    qk_norm, attention_bias, o_proj_bias = True, False, True

    def __init__(self, config: PretrainedConfig, build: ModelBuild):
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        super().__init__(config, build)
        self.packed_modules_mapping = {**self.expert_mapping(config), **Qwen3ForCausalLM.packed_modules_mapping}

    @staticmethod
    def is_sparse(config: PretrainedConfig, layer: int) -> bool:
        return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer + 1) % config.decoder_sparse_step == 0)

    def make_mlp(self, config: PretrainedConfig, layer: int, build: ModelBuild, prefix: str) -> nn.Module:
        if not self.is_sparse(config, layer):
            return Qwen3MLP(config, build=build, prefix=prefix)
        return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                        config.moe_intermediate_size, bool(config.norm_topk_prob), build=build, prefix=prefix)

    def expert_mapping(self, config: PretrainedConfig) -> dict:
        return expert_mapping(config.num_experts, "gate_proj", "up_proj", "down_proj")
