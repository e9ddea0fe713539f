"""Llama (2, 3, 3.1+ with "llama3" RoPE scaling): Qwen3's decoder without q/k norm; q/k/v/o biases
follow attention_bias and MLP biases follow mlp_bias, both off in the released checkpoints."""
from nanoinfer.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    qk_norm, attention_bias, o_proj_bias = False, False, True
