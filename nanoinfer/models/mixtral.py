"""Mixtral (sparse MLP in every layer, top-k weights always renormalised, no q/k norm, no biases) and
Mistral (Llama's architecture). Attention with a sliding window shorter than the context is refused
in models/__init__.py: we have no windowed attention, and ignoring it would silently change outputs.

Mixtral checkpoints name the sparse block `block_sparse_moe` and the expert projections w1 (gate),
w3 (up), w2 (down); the loader maps them onto FusedMoE under our `mlp` name."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.models.llama import LlamaForCausalLM
from nanoinfer.models.qwen3_moe import Qwen3MoeForCausalLM, expert_mapping


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False

    def make_mlp(self, config: PretrainedConfig, layer: int, build: ModelBuild, prefix: str) -> nn.Module:
        return FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                        config.intermediate_size, renormalize=True, build=build, prefix=prefix)

    def expert_mapping(self, config: PretrainedConfig) -> dict:
        experts = expert_mapping(config.num_local_experts, "w1", "w3", "w2", ckpt="block_sparse_moe.experts",
                                 ours="mlp.experts")
        return {**experts, "block_sparse_moe.gate": ("mlp.gate", None)}


class MistralForCausalLM(LlamaForCausalLM):
    pass
