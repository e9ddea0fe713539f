"""Qwen3 decoder (q/k RMSNorm; q/k/v/o biases only with attention_bias); Qwen2/Qwen2.5 checkpoints
share it (q/k/v biases, no o bias, no q/k norm). Projections are fused (qkv, gate_up) and tensor-parallel."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import SiluAndMul
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import Deferred, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.rotary_embedding import RotaryEmbedding
from nanoinfer.utils.context import get_context


def rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_scaling(config: PretrainedConfig) -> dict | None:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)


class Qwen3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool, bias: bool, o_bias: bool):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_theta(config),
                                          rope_scaling(config))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: "torch.Tensor | Deferred", reduce_later: bool = False):
        """reduce_later: the caller normalises the output next, and can take a PartialSum
        (RowParallelLinear)."""
        qkv = self.qkv_proj(hidden)
        n = qkv.shape[0]
        if qkv.is_cuda:  # q/k norm, RoPE and the K/V store in one kernel; attention reads K/V from the cache
            from nanoinfer.kernels.qkv_epilogue import qkv_epilogue
            q = qkv_epilogue(qkv, positions, self.rotary_emb.cos_sin_cache,
                             self.q_norm.weight if self.qk_norm else None,
                             self.k_norm.weight if self.qk_norm else None,
                             self.q_norm.eps if self.qk_norm else 0.0, self.attn.k_cache, self.attn.v_cache,
                             get_context().slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn(q), reduce_later)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v), reduce_later)


class Qwen3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        bias = bool(getattr(config, "mlp_bias", False))  # Llama's option; Qwen has none
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x, reduce_later: bool = False):
        return self.down_proj(self.act_fn(self.gate_up_proj(x), defer=True), reduce_later)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool, bias: bool, o_bias: bool):
        super().__init__()
        self.self_attn = Qwen3Attention(config, qk_norm, bias, o_bias)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # (defer: at batch 1 on CUDA the norms run inside the next projection's GEMV, unless the
        # tensor-parallel all-reduce before them already does)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, defer=True)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, defer=True)
        # (reduce_later: with tensor parallelism, the all-reduces run inside the norms after them)
        hidden = self.self_attn(positions, hidden, reduce_later=True)
        dense = isinstance(self.mlp, Qwen3MLP)
        hidden, residual = self.post_attention_layernorm(hidden, residual, defer=dense)
        return (self.mlp(hidden, reduce_later=True) if dense else self.mlp(hidden)), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool, bias: bool, o_bias: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, qk_norm, bias, o_bias) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qk_norm, attention_bias, o_proj_bias = True, False, True  # o_proj_bias: follows attention_bias

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = getattr(config, "attention_bias", self.attention_bias)
        self.model = Qwen3Model(config, self.qk_norm, bias, bias and self.o_proj_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    qk_norm, attention_bias, o_proj_bias = False, True, False
