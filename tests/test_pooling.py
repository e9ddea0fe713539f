"""Embeddings (runner="pooling"): equal to HF AutoModel's final hidden states, pooled (last token,
mean, CLS), cut to `dimensions` and normalised; through chunked prefill and prefix-cache hits; no
KV kept; no decode step; bad input refused."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from nanoinfer.pooling.feature import PoolingFeature
from nanoinfer import LLM, PoolingParams, SamplingParams

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog " * 3, "A", "paged KV cache"]
_HF = {}


def hf_hidden(path: str, ids: list[int]) -> torch.Tensor:
    """HF AutoModel's last hidden state [len(ids), hidden], float32."""
    if path not in _HF:
        _HF[path] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[path](torch.tensor([ids])).last_hidden_state[0].float()


def reference(path, ids, pooling="LAST", dimensions=None, normalize=True) -> torch.Tensor:
    h = hf_hidden(path, ids)
    x = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
    if dimensions is not None:
        x = x[:dimensions]
    return torch.nn.functional.normalize(x, dim=0) if normalize else x


def assert_close(ours: list[float], ref: torch.Tensor, normalized=True):
    ours = torch.tensor(ours)
    assert ours.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > 0.9999
    if normalized:
        assert abs(float(ours.norm()) - 1) < 1e-5
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


def with_pooling(src: str, dst, mode: str) -> str:
    """A copy of the checkpoint with sentence-transformers files asking for `mode` pooling."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], f)
    os.makedirs(os.path.join(dst, "1_Pooling"))
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
             "pooling_mode_lasttoken": False, mode: True}
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **flags}, f)
    return str(dst)


def check_clean(llm):
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and not llm.requests
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_last_token_embeddings_equal_hf(make_checkpoint, arch):
    """Default pooling (no sentence-transformers files): the last token, normalised. A token
    budget of 16 chunks the long prompt; the second call hits the prefix cache."""
    path = make_checkpoint(arch=arch)
    llm = LLM(path, runner="pooling", kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=16,
              num_kvcache_blocks=64)
    try:
        llm.step_log = []
        outs = llm.embed(PROMPTS, use_tqdm=False)
        assert len(outs) == len(PROMPTS)
        for out in outs:
            assert out.finished and out.prompt_token_ids == llm.tokenizer.encode(PROMPTS[outs.index(out)])
            assert_close(out.outputs.embedding, reference(path, out.prompt_token_ids))
        assert all(r.num_decode == 0 for r in llm.step_log), "an embedding never decodes"
        assert max(len(r.rows) and sum(q for q, _ in r.rows) for r in llm.step_log) <= 16
        check_clean(llm)
        again = llm.encode([PROMPTS[1], PROMPTS[1] + " and more"], use_tqdm=False)
        assert again[1].num_cached_tokens > 0, "a last-token embedding takes prefix-cache hits"
        for out in again:
            assert_close(out.outputs.data.tolist(), reference(path, out.prompt_token_ids))
        check_clean(llm)
    finally:
        llm.exit()


@pytest.mark.parametrize("mode,pooling", [("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
                                          ("pooling_mode_lasttoken", "LAST")])
def test_pooling_type_from_sentence_transformers_files(make_checkpoint, tmp_path, mode, pooling):
    """Mean pooling sums every chunk (budget 16 tokens); mean and CLS take no prefix-cache hit."""
    path = with_pooling(make_checkpoint(), tmp_path / "st", mode)
    llm = LLM(path, task="embed", kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=16,
              num_kvcache_blocks=64)
    try:
        assert llm.feature(PoolingFeature).pooling_type == pooling
        for _ in range(2):  # the second time, the prompts' blocks are in the prefix cache
            outs = llm.embed(PROMPTS, use_tqdm=False)
            for out in outs:
                assert_close(out.outputs.embedding, reference(path, out.prompt_token_ids, pooling))
        check_clean(llm)
    finally:
        llm.exit()


def test_sentence_transformers_steps_we_do_not_run_are_refused(make_checkpoint, tmp_path):
    """A module after the pooling that changes the embedding (a Dense projection, as stella's
    2_Dense) or a pooling that leaves the prompt out (include_prompt: false) is refused, naming it,
    rather than skipped (the embedding would be silently another)."""
    from nanoinfer.pooling.pooling_config import read_pooling_type
    dense = with_pooling(make_checkpoint(), tmp_path / "dense", "pooling_mode_mean_tokens")
    with open(os.path.join(dense, "modules.json")) as f:
        modules = json.load(f)
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    with open(os.path.join(dense, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match=r"2_Dense.*sentence_transformers\.models\.Dense"):
        LLM(dense, runner="pooling", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=8)
    no_prompt = with_pooling(make_checkpoint(), tmp_path / "instruct", "pooling_mode_mean_tokens")
    config = os.path.join(no_prompt, "1_Pooling", "config.json")
    with open(config) as f:
        flags = json.load(f)
    with open(config, "w") as f:
        json.dump({**flags, "include_prompt": False}, f)
    with pytest.raises(ValueError, match="include_prompt"):
        read_pooling_type(no_prompt)
    with open(config, "w") as f:
        json.dump({**flags, "include_prompt": True}, f)
    assert read_pooling_type(no_prompt) == "MEAN"


def test_dimensions_and_normalize(make_checkpoint, tmp_path):
    path = with_pooling(make_checkpoint(), tmp_path / "mean", "pooling_mode_mean_tokens")
    llm = LLM(path, runner="pooling", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=32)
    try:
        params = [PoolingParams(dimensions=16), PoolingParams(normalize=False), None, PoolingParams(dimensions=64)]
        outs = llm.embed(PROMPTS, pooling_params=params, use_tqdm=False)
        assert [len(o.outputs.embedding) for o in outs] == [16, 64, 64, 64]
        assert_close(outs[0].outputs.embedding, reference(path, outs[0].prompt_token_ids, "MEAN", dimensions=16))
        assert_close(outs[1].outputs.embedding, reference(path, outs[1].prompt_token_ids, "MEAN", normalize=False),
                     normalized=False)
        assert_close(outs[2].outputs.embedding, reference(path, outs[2].prompt_token_ids, "MEAN"))
        one = llm.embed(PROMPTS[:2], PoolingParams(dimensions=8), use_tqdm=False)  # one for all
        assert [len(o.outputs.embedding) for o in one] == [8, 8]
    finally:
        llm.exit()


def test_score_is_the_cosine_of_the_embeddings(tiny_qwen3):
    llm = LLM(tiny_qwen3, runner="pooling", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=32)
    try:
        emb = [torch.tensor(o.outputs.embedding) for o in llm.embed(PROMPTS, use_tqdm=False)]
        many = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
        assert len(many) == 3
        for out, e in zip(many, emb[1:]):
            assert abs(out.outputs.score - float(emb[0] @ e)) < 1e-5
        pairs = llm.score(PROMPTS[:2], PROMPTS[2:], use_tqdm=False)
        assert [round(p.outputs.score, 5) for p in pairs] == [round(float(emb[0] @ emb[2]), 5),
                                                               round(float(emb[1] @ emb[3]), 5)]
        assert abs(llm.score(PROMPTS[0], PROMPTS[0], use_tqdm=False)[0].outputs.score - 1) < 1e-5
        with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
            llm.score(PROMPTS[:2], PROMPTS[1:], use_tqdm=False)
    finally:
        llm.exit()


def test_base_model_checkpoint_without_lm_head(make_checkpoint, tmp_path):
    """An embedding checkpoint saved as a base model (keys without `model.`, no lm_head, untied),
    as Qwen3-Embedding's: it loads for pooling and embeds as the full checkpoint does."""
    src = make_checkpoint(tie_word_embeddings=False)
    dst = tmp_path / "base"
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    ours = LLM(str(dst), runner="pooling", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=32)
    try:
        outs = ours.embed(PROMPTS, use_tqdm=False)
        for out in outs:
            assert_close(out.outputs.embedding, reference(src, out.prompt_token_ids))
    finally:
        ours.exit()


def test_bad_input(tiny_qwen3):
    llm = LLM(tiny_qwen3, runner="pooling", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=16)
    gen = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=16)
    try:
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate("hi", use_tqdm=False)
        with pytest.raises(ValueError, match="runner='pooling'"):
            gen.embed("hi", use_tqdm=False)
        with pytest.raises(ValueError, match="does not generate"):
            llm.add_request("hi", SamplingParams())
        with pytest.raises(TypeError, match="pooling_params must be PoolingParams"):
            llm.embed("hi", {"dimensions": 3}, use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions must be at most the model's hidden size 64"):
            llm.embed("hi", PoolingParams(dimensions=65), use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions must be >= 1"):
            PoolingParams(dimensions=0)
        with pytest.raises(ValueError, match="normalize must be a bool"):
            PoolingParams(normalize="yes")
        with pytest.raises(ValueError, match="2 pooling_params for 1 prompts"):
            llm.embed(["hi"], [PoolingParams(), PoolingParams()], use_tqdm=False)
        with pytest.raises(ValueError, match="prompt is an empty string"):
            llm.embed("", use_tqdm=False)
        with pytest.raises(ValueError, match="runner must be"):
            LLM(tiny_qwen3, runner="embed")
        with pytest.raises(ValueError, match="contradicts"):
            LLM(tiny_qwen3, runner="generate", task="embed")
        check_clean(llm)
        assert len(llm.embed("hi", use_tqdm=False)[0].outputs.embedding) == 64  # still serving
        assert gen.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    finally:
        llm.exit()
        gen.exit()


def test_a_prompt_may_fill_max_model_len(tiny_qwen3):
    """An embedding never makes a token, so its prompt may be max_model_len tokens (a generating
    request's must leave room for one); one token more is refused naming max_model_len."""
    llm = LLM(tiny_qwen3, runner="pooling", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=16)
    try:
        ids = [(7 * i) % 300 + 3 for i in range(64)]
        out = llm.embed([ids], use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        assert_close(out.outputs.embedding, reference(tiny_qwen3, ids))
        with pytest.raises(ValueError, match="prompt length 65 exceeds max_model_len=64"):
            llm.embed([ids + [5]], use_tqdm=False)
        check_clean(llm)
    finally:
        llm.exit()


def test_abort_frees_the_blocks(tiny_qwen3):
    llm = LLM(tiny_qwen3, runner="pooling", kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=16,
              num_kvcache_blocks=32)
    try:
        rid = llm.add_requests([PROMPTS[1]], [PoolingParams()], keep_output=True)[0]
        llm.advance()
        out = llm.pop_output(rid)  # aborts it mid-prompt
        assert not out.finished and out.outputs.data.numel() == 0
        llm.advance()
        check_clean(llm)
    finally:
        llm.exit()


def test_tensor_parallel_embeddings_equal_one_rank(tiny_qwen3):
    """tp=2 (CPU, gloo): the ranks' forward all-reduces; rank 0's sums come back through the
    worker RPC, equal to one rank's."""
    options = dict(runner="pooling", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=32,
                   max_num_batched_tokens=16)
    one = LLM(tiny_qwen3, **options)
    try:
        want = [o.outputs.embedding for o in one.embed(PROMPTS, use_tqdm=False)]
    finally:
        one.exit()
    two = LLM(tiny_qwen3, tensor_parallel_size=2, **options)
    try:
        got = [o.outputs.embedding for o in two.embed(PROMPTS, use_tqdm=False)]
    finally:
        two.exit()
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode,pooling", [("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN")])
def test_cuda_embeddings_match_hf(make_checkpoint, make_llm, tmp_path, mode, pooling):
    """On the GPU (Triton attention, eager embedding steps, float32): batched and chunked prompts
    against HF on the CPU; bf16 within bf16's reach."""
    path = with_pooling(make_checkpoint(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128), tmp_path / "st",
                        mode)
    prompts = [[(13 * i + 7 * j) % 300 + 3 for j in range(5 + 37 * i)] for i in range(6)]
    for dtype, cosine in (("float32", 0.9999), ("bfloat16", 0.99)):
        llm = make_llm(path, runner="pooling", dtype=dtype, kvcache_block_size=16, max_model_len=512,
                       max_num_batched_tokens=128)
        try:
            outs = llm.embed(prompts, use_tqdm=False)
            for p, out in zip(prompts, outs):
                ref = reference(path, p, pooling)
                assert torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0) > cosine
            check_clean(llm)
        finally:
            llm.exit()
