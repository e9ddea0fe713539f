"""The LoRA benchmark (nanoinfer/bench/lora.py) runs end to end at a tiny size on CPU: its random
PEFT adapters load, and both engines give a throughput and a decode step time."""
from nanoinfer.bench.lora import compare, make_random_adapters
from nanoinfer.lora.intake import LoRAIntake
from nanoinfer.config import Config
from nanoinfer import LoRARequest


def test_random_adapters_are_valid_peft_adapters(tiny_qwen3):
    intake = LoRAIntake(Config(tiny_qwen3, enable_lora=True, max_lora_rank=4))
    for i, path in enumerate(make_random_adapters(tiny_qwen3, 2, 4)):
        intake.check(LoRARequest(f"a{i}", i + 1, path))


def test_the_comparison_runs(tiny_qwen3, capsys):
    results = compare(tiny_qwen3, 2, 4, [1, 3], 8, 3, dummy=False, kvcache_block_size=16, num_kvcache_blocks=64)
    for mode in ("base", "lora"):
        for batch in (1, 3):
            tok_s, step, _ = results[(mode, batch)]
            assert tok_s > 0 and step > 0
    assert results[("lora", 3)][2] > 0, "the adapters' share was timed"
    assert "LoRA/base" in capsys.readouterr().out
