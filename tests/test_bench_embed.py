"""The embedding benchmark (nanoinfer/bench/embed.py) runs at a tiny size on CPU, and its prefill
bound adds up as its text says."""
from types import SimpleNamespace

from nanoinfer.bench.embed import main, prefill_bound
from nanoinfer.engine.step_record import StepRecord


def test_runs_on_cpu_at_a_tiny_size(tiny_qwen3, capsys):
    seconds, steps = main(["--model", tiny_qwen3, "--num-prompts", "6", "--prompt-len", "24",
                           "--max-num-batched-tokens", "64", "--repeat", "1"])
    assert seconds > 0 and all(r.num_decode == 0 for r in steps)
    assert sum(q for r in steps for q, _ in r.rows) == 6 * 24, "every prompt token computed once (no cache)"
    assert "6 prompts x 24 tokens" in capsys.readouterr().out


def test_prefill_bound_arithmetic():
    hf = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=2, head_dim=4,
                         hidden_size=8, vocab_size=10, tie_word_embeddings=True)
    weight_bytes, dtype_bytes = 2 * 1000, 2  # 1000 parameters, 80 of them the (tied) embedding
    step = StepRecord([(3, 3), (2, 5)], 0, 0, 0, 0, 0)  # a whole 3-token prompt, a 2-token chunk after 3 cached
    kv = 5 * 2 * 1 * 4 * 2 * 2  # tokens x layers x kv heads x head_dim x (K, V) x bytes
    pairs = 6 + (2 * 3 + 3)
    flops = 2 * 920 * 5 + 4 * 2 * 2 * 4 * pairs
    assert abs(prefill_bound([step], hf, weight_bytes, dtype_bytes, 100.0, 1000.0)
               - ((920 * 2 + kv) / 100.0 + flops / 1000.0)) < 1e-9  # (the embedding is gathered, not read)
