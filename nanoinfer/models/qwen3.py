"""Qwen3 decoder (q/k RMSNorm; q/k/v/o biases only with attention_bias); Qwen2/Qwen2.5 checkpoints
share it (q/k/v biases, no o bias, no q/k norm). Projections are fused (qkv, gate_up) and tensor-parallel.
Every module is built with the model's build (layers/model_build.py) and its module name (`prefix`),
the checkpoint's name for its weights."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import SiluAndMul
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.fused_norm import add_norm_for
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.linear_method import Deferred
from nanoinfer.layers.model_build import ModelBuild, join
from nanoinfer.layers.rotary_embedding import RotaryEmbedding
from nanoinfer.models.config_limits import head_dim, rope_scaling, rope_theta


class Qwen3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool, bias: bool, o_bias: bool, rotary: RotaryEmbedding, *,
                 build: ModelBuild, prefix: str):
        super().__init__()
        dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, build=build,
                                          prefix=join(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(config.num_attention_heads * dim, config.hidden_size, bias=o_bias,
                                        build=build, prefix=join(prefix, "o_proj"))
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, dim, dim ** -0.5, rotary,
                              backend=build.attention_backend)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(dim, config.rms_norm_eps) if qk_norm else None

    def takes_deferred(self, x: torch.Tensor) -> bool:
        return self.qkv_proj.takes_deferred(x)

    def forward(self, positions: torch.Tensor, hidden: "torch.Tensor | Deferred", reduce_later: bool = False):
        """reduce_later: the caller normalises the output next and takes a PartialSum (RowParallelLinear)."""
        qkv = self.qkv_proj(hidden)
        return self.o_proj(self.attn(qkv, positions, self.q_norm, self.k_norm), reduce_later)


class Qwen3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, *, build: ModelBuild, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        bias = bool(getattr(config, "mlp_bias", False))  # Llama's option; Qwen has none
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                                       build=build, prefix=join(prefix, "gate_up_proj"))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, build=build,
                                           prefix=join(prefix, "down_proj"))
        self.act_fn = SiluAndMul()

    def takes_deferred(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_deferred(x)

    def forward(self, x: "torch.Tensor | Deferred", reduce_later: bool = False):
        h = self.act_fn(self.gate_up_proj(x), defer_to=self.down_proj)
        return self.down_proj(h, reduce_later)


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP. `mlp`: any block with forward(x, reduce_later) and
    `takes_deferred(x)` (dense or sparse)."""

    def __init__(self, config: PretrainedConfig, self_attn: Qwen3Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # reduce_later: the all-reduces after attention and the MLP move into the norms that follow
        hidden, residual = add_norm_for(self.input_layernorm, hidden, residual, self.self_attn)
        hidden = self.self_attn(positions, hidden, reduce_later=True)
        hidden, residual = add_norm_for(self.post_attention_layernorm, hidden, residual, self.mlp)
        return self.mlp(hidden, reduce_later=True), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: list[Qwen3DecoderLayer], *, build: ModelBuild):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=build.tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, inputs_embeds=None, after_layer=None):
        """inputs_embeds: the step's input embeddings when some rows are not token embeddings (images);
        after_layer(i, hidden, residual) -> (hidden, residual): what a model adds to the residual
        stream after layer i (Qwen3-VL's DeepStack features)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if after_layer is not None:
                hidden, residual = after_layer(i, hidden, residual)
        return add_norm_for(self.norm, hidden, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qk_norm, attention_bias, o_proj_bias = True, False, True  # o_proj_bias: follows attention_bias

    def __init__(self, config: PretrainedConfig, build: ModelBuild):
        super().__init__()
        bias = getattr(config, "attention_bias", self.attention_bias)
        o_bias = bias and self.o_proj_bias
        rotary = self.make_rotary(config, build)
        layers = []
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            attn = Qwen3Attention(config, self.qk_norm, bias, o_bias, rotary, build=build,
                                  prefix=join(prefix, "self_attn"))
            layers.append(Qwen3DecoderLayer(config, attn, self.make_mlp(config, i, build, join(prefix, "mlp"))))
        self.model = Qwen3Model(config, layers, build=build)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=build.tp,
                                      method=build.lm_head_method)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_rotary(self, config: PretrainedConfig, build: ModelBuild) -> RotaryEmbedding:
        """The one RoPE cos/sin cache for every layer, sized by max_model_len."""
        return RotaryEmbedding(head_dim(config), build.rope_positions(config.max_position_embeddings),
                               rope_theta(config), rope_scaling(config))

    def make_mlp(self, config: PretrainedConfig, layer: int, build: ModelBuild, prefix: str) -> nn.Module:
        """The MLP of decoder layer `layer` (the MoE models override it)."""
        return Qwen3MLP(config, build=build, prefix=prefix)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    qk_norm, attention_bias, o_proj_bias = False, True, False
