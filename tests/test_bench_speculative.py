"""The speculative-decoding benchmark (nanoinfer/bench/speculative.py) runs end to end at a tiny
size on CPU: a draft equal to its target accepts every proposal, a disagreeing one about none,
and the computed table is printed."""
from nanoinfer.bench.speculative import compare, expected_tokens


def test_expected_tokens_per_step():
    assert expected_tokens(0.5, 1) == 1.5 and abs(expected_tokens(0.7, 3) - (1 + 0.7 + 0.49 + 0.343)) < 1e-12


def test_the_comparison_runs(tiny_qwen3, make_checkpoint, capsys):
    draft = make_checkpoint(seed=1, num_layers=1)
    results = compare(tiny_qwen3, draft, 2, [1, 3], 8, 10, dummy=False, max_model_len=128,
                      runs=("plain", "same", "other", "other-sync", "policy"),
                      kvcache_block_size=16, num_kvcache_blocks=64)
    for batch in (1, 3):
        assert results["draft = target", batch]["accepted"] == 2  # every proposal, every row
        assert results["disagreeing draft", batch]["accepted"] < 1
        assert all(results[name, batch]["tok_s"] > 0 for name in ("plain", "disagreeing draft, policy on"))
    assert "x at 0.7" in capsys.readouterr().out
