"""Checkpoint directories of real models' shapes with no weights, for the benchmarks: a config.json
and a small locally trained tokenizer. The engine makes random weights (load_format="dummy"):
throughput does not depend on the weights, and nothing is downloaded."""
import json
import os
import tempfile

from nanoinfer.utils.tiny_model import train_tokenizer

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                    moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # the full vocabulary on a toy body: the host's and the sampler's per-step work on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def make_random_model_dir(shape: str) -> str:
    """The directory of a Qwen3 model of `shape` (a key of SHAPES), in the system's temporary
    directory; load it with load_format='dummy'."""
    path = os.path.join(tempfile.gettempdir(), f"nanoinfer-bench-qwen3-{shape}")
    os.makedirs(path, exist_ok=True)
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_act="silu",
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                  torch_dtype="bfloat16", eos_token_id=2, bos_token_id=None)
    config.update(SHAPES[shape])  # an MoE shape brings its own architecture
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    train_tokenizer().save_pretrained(path)
    return path
