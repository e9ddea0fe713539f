"""Greedy output must be Hugging Face's argmax at every position (teacher-forced), on many shapes."""
import pytest

from hf_reference import assert_greedy_matches_hf
from nanoinfer import LLM, SamplingParams

SHAPES = {
    "qwen3-gqa2-tied": dict(),
    "qwen3-mha-untied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=False),
    "qwen3-single-kv-head": dict(num_heads=4, num_kv_heads=1),
    "qwen3-gqa4-headdim32": dict(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=32, num_layers=3),
    "qwen3-padded-vocab": dict(vocab_size=500, tie_word_embeddings=False),
    "qwen3-attention-bias": dict(attention_bias=True, num_heads=4, num_kv_heads=2),
    "qwen2-bias": dict(arch="qwen2", num_heads=4, num_kv_heads=2),
    "llama-gqa2-untied": dict(arch="llama", num_heads=4, num_kv_heads=2, tie_word_embeddings=False),
    "llama3-rope-biases": dict(arch="llama", num_heads=4, num_kv_heads=1, llama3_rope=True, attention_bias=True,
                               mlp_bias=True),
    "qwen2-single-kv-untied": dict(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=False),
}

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. Large language models predict",
           "你好，世界！"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_matches_hf(make_checkpoint, shape):
    path = make_checkpoint(**SHAPES[shape])
    llm = LLM(path, kvcache_block_size=16, max_model_len=256)
    try:
        prompts = PROMPTS + [[(i * 37) % llm.vocab_size for i in range(1, 41)]]  # ids past the tokenizer too
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            assert len(out["token_ids"]) == 24
            assert_greedy_matches_hf(path, ids, out["token_ids"])
    finally:
        llm.exit()
