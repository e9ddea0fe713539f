"""LLM options (Config): vLLM's keywords and aliases, numpy numbers, bounds, paths, remote code."""
import json
import shutil

import numpy as np
import pytest
import torch

from nanoinfer.config import MAX_KVCACHE_BLOCK_SIZE, Config


def test_vllm_keywords_and_defaults(tiny_qwen3):
    c = Config.from_options(tiny_qwen3)
    assert (c.tokenizer, c.enable_prefix_caching, c.trust_remote_code) == (tiny_qwen3, True, False)
    assert c.kvcache_block_size == c.block_size == 256
    c = Config.from_options(tiny_qwen3, enable_prefix_caching=False, trust_remote_code=False, block_size=32, seed=3)
    assert (c.enable_prefix_caching, c.kvcache_block_size, c.block_size, c.seed) == (False, 32, 32, 3)
    assert Config.from_options(tiny_qwen3, block_size=64, kvcache_block_size=64).kvcache_block_size == 64


@pytest.mark.parametrize("name, dtype", [("half", torch.float16), ("float", torch.float32),
                                         ("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_dtype_names(tiny_qwen3, name, dtype):
    assert Config.from_options(tiny_qwen3, dtype=name).torch_dtype == dtype


@pytest.mark.parametrize("options, error, match", [
    (dict(trust_remote_code=True), ValueError, "trust_remote_code=True is not supported"),
    (dict(trust_remote_code=1), TypeError, "trust_remote_code must be a bool"),
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching must be a bool"),
    (dict(block_size=32, kvcache_block_size=64), ValueError, "block_size=32 and kvcache_block_size=64"),
    (dict(block_size=48), ValueError, "power of two"),
    (dict(block_size=8), ValueError, r"block_size must be \[16, 65536\]"),
    (dict(kvcache_block_size=2 * MAX_KVCACHE_BLOCK_SIZE), ValueError, r"kvcache_block_size must be \[16, 65536\]"),
    (dict(kvcache_block_size=2**24), ValueError, "kvcache_block_size"),
    (dict(seed=2**64), ValueError, r"seed must be \[0, 18446744073709551615\]"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=np.float64(3)), TypeError, "seed must be an int"),
    (dict(max_num_seqs=np.bool_(True)), TypeError, "max_num_seqs"),
    (dict(max_num_seqs=True), TypeError, "max_num_seqs"),
    (dict(gpu_memory_utilization="0.5"), TypeError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=10**400), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(dtype="double"), ValueError, "'half'"),
    (dict(dtype=["half"]), ValueError, "dtype"),
    (dict(tokenizer=3), TypeError, "tokenizer must be a path"),
    (dict(tokenizer="/no/such/dir"), ValueError, "tokenizer '/no/such/dir' is neither"),
])
def test_bad_options(tiny_qwen3, options, error, match):
    with pytest.raises(error, match=match):
        Config.from_options(tiny_qwen3, **options)


def test_unknown_option_lists_the_valid_ones(tiny_qwen3):
    with pytest.raises(TypeError, match="no_such_option.*valid options.*'block_size'.*'enable_prefix_caching'"
                                        ".*'tokenizer'.*'trust_remote_code'"):
        Config.from_options(tiny_qwen3, no_such_option=1)


def test_numpy_numbers_are_accepted_and_converted(tiny_qwen3):
    c = Config.from_options(tiny_qwen3, max_num_seqs=np.int32(8), max_model_len=np.int64(128),
                            kvcache_block_size=np.uint16(16), num_kvcache_blocks=np.int64(40),
                            seed=np.uint64(2**64 - 1), gpu_memory_utilization=np.float32(0.5),
                            tensor_parallel_size=np.int8(1), max_num_batched_tokens=np.int64(256))
    for name in ("max_num_seqs", "max_model_len", "kvcache_block_size", "num_kvcache_blocks", "seed",
                 "tensor_parallel_size", "max_num_batched_tokens"):
        assert type(getattr(c, name)) is int, name
    assert (c.max_num_seqs, c.seed, c.kvcache_block_size) == (8, 2**64 - 1, 16)
    assert type(c.gpu_memory_utilization) is float and c.gpu_memory_utilization == 0.5


def test_home_directory_is_expanded(tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_qwen3, tmp_path / "ckpt")
    shutil.copytree(tiny_qwen3, tmp_path / "tok")
    assert Config.from_options("~/ckpt").model == str(tmp_path / "ckpt")
    c = Config.from_options("~/ckpt", tokenizer="~/tok")
    assert (c.model, c.tokenizer) == (str(tmp_path / "ckpt"), str(tmp_path / "tok"))


def test_separate_tokenizer_directory_needs_no_config(tiny_qwen3, tmp_path):
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_qwen3}/{name}", tmp_path / "tok")
    assert Config.from_options(tiny_qwen3, tokenizer=str(tmp_path / "tok")).tokenizer == str(tmp_path / "tok")


def test_custom_code_config_is_refused_without_prompting(tiny_qwen3, tmp_path, monkeypatch):
    """A config whose model_type is unknown and whose auto_map names checkpoint code: transformers
    would ask on stdin whether to run it; nanoinfer never runs it and says so."""
    prompts = []
    monkeypatch.setattr("builtins.input", lambda *a: prompts.append(a) or "n")
    path = tmp_path / "custom"
    shutil.copytree(tiny_qwen3, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="my_custom_lm", architectures=["MyCustomLM"],
               auto_map={"AutoConfig": "configuration_custom.MyConfig", "AutoModelForCausalLM": "modeling_custom.MyLM"})
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="runs no code from a checkpoint"):
        Config.from_options(str(path))
    assert prompts == []


def test_max_model_len_beyond_the_model_is_refused(make_checkpoint):
    """As vLLM: never clipped silently; left out, it is 4096 or the model's limit if lower."""
    path = make_checkpoint(max_position_embeddings=512)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's max_position_embeddings=512"):
        Config.from_options(path, max_model_len=100000)
    assert Config.from_options(path).max_model_len == 512
    assert Config.from_options(path, max_model_len=512).max_model_len == 512
    with pytest.raises(TypeError, match="max_model_len must be an int"):
        Config.from_options(path, max_model_len="4096")
