"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse MLP (router + experts) in the layers HF
makes sparse: not in `mlp_only_layers` and (layer + 1) % `decoder_sparse_step` == 0; the others keep
a dense MLP of `intermediate_size`. Routing renormalises the top-k weights when `norm_topk_prob`.

The checkpoint stores each expert's projections (mlp.experts.N.gate_proj/up_proj/down_proj); the
loader stacks them into FusedMoE's [E, 2I, H] and [E, H, I] through per-expert entries of
`packed_modules_mapping`, built from the config (they come before the dense gate_proj/up_proj
entries, which would also match an expert's name)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model


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


class MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's decoder layer (same forward) around the given MLP, dense or sparse."""

    def __init__(self, config: PretrainedConfig, mlp: nn.Module, qk_norm: bool, bias: bool, o_bias: bool):
        nn.Module.__init__(self)  # Qwen3DecoderLayer's __init__ would build a dense MLP
        self.self_attn = Qwen3Attention(config, qk_norm, bias, o_bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoeModel(Qwen3Model):
    """Qwen3Model's forward over MoeDecoderLayers; `mlps` holds each layer's MLP."""

    def __init__(self, config: PretrainedConfig, mlps: list[nn.Module], qk_norm: bool, bias: bool, o_bias: bool):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoeDecoderLayer(config, mlp, qk_norm, bias, o_bias) for mlp in mlps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    qk_norm = True

    def __init__(self, config: PretrainedConfig):
        nn.Module.__init__(self)
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        bias = bool(getattr(config, "attention_bias", False))
        self.model = MoeModel(config, self.make_mlps(config), self.qk_norm, bias, bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_modules_mapping = {**self.expert_mapping(config), **Qwen3ForCausalLM.packed_modules_mapping}

    @staticmethod
    def is_sparse(config: PretrainedConfig, layer: int) -> bool:
        return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer + 1) % config.decoder_sparse_step == 0)

    def make_mlps(self, config: PretrainedConfig) -> list[nn.Module]:
        return [FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                         config.moe_intermediate_size, bool(config.norm_topk_prob))
                if self.is_sparse(config, i) else Qwen3MLP(config) for i in range(config.num_hidden_layers)]

    def expert_mapping(self, config: PretrainedConfig) -> dict:
        return expert_mapping(config.num_experts, "gate_proj", "up_proj", "down_proj")
