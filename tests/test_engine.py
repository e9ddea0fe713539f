"""End-to-end engine behaviour on CPU: preemption, prefix cache and chunked prefill never change
greedy results; the hand loop; bad input is rejected cleanly and the engine keeps serving."""
import random

import pytest

from hf_reference import assert_greedy_matches_hf
from nanoinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def random_prompts(n, vocab, seed=0, lo=5, hi=70, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    """Greedy outputs from a roomy engine, checked against HF once."""
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256)
    prompts = random_prompts(10, llm.vocab_size, shared=20)
    outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.exit()
    for p, o in zip(prompts, outs):
        assert_greedy_matches_hf(tiny_qwen3, p, o)
    return prompts, outs


def test_forced_preemption_gives_identical_results(tiny_qwen3, reference):
    prompts, expected = reference
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=12)
    try:
        outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.scheduler.num_preemptions > 0, "the tiny pool should have forced preemption"
        assert outs == expected
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    finally:
        llm.exit()


def test_async_scheduling_gives_identical_results(tiny_qwen3, reference):
    """Overlapped decode plans a step before the previous one's tokens are known; with EOS stops
    (not ignore_eos), chunked prefill and a tight pool, results must equal the synchronous loop."""
    prompts, expected = reference
    # mid-stream stops: a token each of some greedy completions becomes a stop token id
    stops = [[e[k]] if k else None for e, k in zip(expected, (7, 0, 12, 0, 3, 20, 0, 9, 0, 15))]
    sp = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=st)
          for m, st in zip((5, 40, 17, 33, 1, 40, 2, 29, 40, 11), stops)]
    outs = {}
    for mode in (True, False):
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=14,
                  max_num_batched_tokens=40, async_scheduling=mode)
        outs[mode] = [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.is_finished()
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        llm.exit()
    assert outs[True] == outs[False]
    assert any(len(o) < p.max_tokens for o, p in zip(outs[True], sp)), "no request stopped early"


def test_warm_prefix_cache_gives_identical_results(tiny_qwen3, reference):
    prompts, expected = reference
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256)
    try:
        first = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        # a second pass, now over a warm cache (shared 20-token prefix + each prompt's own blocks)
        rids = [llm.add_request(p, GREEDY) for p in prompts]
        done = {}
        while not llm.is_finished():
            for rid, toks in llm.step()[0]:
                done[rid] = toks
        assert llm.scheduler.block_manager.num_hits > 0
        assert first == expected and [done[rid] for rid in rids] == expected
    finally:
        llm.exit()


def test_chunked_prefill_gives_identical_results(tiny_qwen3, reference):
    prompts, expected = reference
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outs == expected
    finally:
        llm.exit()


def test_steps_of_short_rows_give_identical_results(tiny_qwen3, reference, monkeypatch):
    """Prompt chunks of at most SHORT_ROWS_MAX_QUERY tokens beside decode rows run as decode steps,
    a token a row (engine/forward_inputs.py): the results are the reference's."""
    from nanoinfer.engine import forward_inputs
    short = []
    original = forward_inputs._short_rows_context
    monkeypatch.setattr(forward_inputs, "_short_rows_context", lambda *a: short.append(1) or original(*a))
    prompts, expected = reference
    q = forward_inputs.SHORT_ROWS_MAX_QUERY
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=q, max_num_seqs=q)
    try:
        outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outs == expected
        assert len(short) > 10
    finally:
        llm.exit()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_hand_loop_and_step_outputs(tiny_qwen3, async_scheduling):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128, async_scheduling=async_scheduling)
    try:
        prompt_len = len(llm.tokenizer.encode("Hello, my name is")) + 4
        ids = [llm.add_request("Hello, my name is", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
               llm.add_request([1, 2, 3, 4], SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True))]
        assert len(set(ids)) == 2
        finished, prefill_tokens, decode_tokens = {}, 0, 0
        while not llm.is_finished():
            outputs, num_tokens = llm.step()
            prefill_tokens += max(num_tokens, 0)
            decode_tokens -= min(num_tokens, 0)
            finished.update(outputs)
        assert set(finished) == set(ids)
        assert len(finished[ids[0]]) == 5 and len(finished[ids[1]]) == 3
        # each prompt token once; each completion token after the first (sampled by the prefill) once
        assert prefill_tokens == prompt_len and decode_tokens == (5 - 1) + (3 - 1)
        assert llm.step() == ([], 0)
    finally:
        llm.exit()


def test_generate_shapes_and_eos(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128)
    try:
        single = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(single) == 1 and isinstance(single[0]["text"], str)
        as_ids = llm.generate([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
        assert len(as_ids) == 1
        # EOS ends a request unless ignore_eos: force it by making EOS the only high-probability token
        eos = llm.tokenizer.eos_token_id
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0]
        assert eos not in out["token_ids"][:-1]
        assert len(out["token_ids"]) == 50 or out["token_ids"][-1] in llm.eos_token_ids
        assert set(llm.eos_token_ids) >= {eos, llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    finally:
        llm.exit()


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=8)
    yield llm
    llm.exit()


@pytest.mark.parametrize("prompt, params, error, match", [
    ("", None, ValueError, "empty"),
    ([], None, ValueError, "empty"),
    ([1] * 64, SamplingParams(max_tokens=10), ValueError, "max_model_len"),  # no room for one token
    ([1] * 65, SamplingParams(max_tokens=1), ValueError, "max_model_len"),
    ([1, 10**6], None, ValueError, r"\[0, "),
    ([1, -1], None, ValueError, r"\[0, "),
    ([1.5, 2], None, TypeError, "ints"),
    (123, None, TypeError, "prompt"),
    ("hi", "greedy", TypeError, "SamplingParams"),
])
def test_bad_requests_are_rejected_and_engine_keeps_serving(engine, prompt, params, error, match):
    with pytest.raises(error, match=match):
        engine.add_request(prompt, params)
    assert engine.is_finished()
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0]["token_ids"]) >= 1


def test_bad_generate_batch_adds_nothing(engine):
    with pytest.raises(ValueError, match="sampling_params"):
        engine.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError):
        engine.generate(["hello", ""], use_tqdm=False)
    assert engine.is_finished()


def test_max_length_request_fills_the_whole_pool(tiny_qwen3):
    """The start-up check guarantees one max_model_len sequence fits the pool; it must then run."""
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=16)
    try:
        out = llm.generate([[1] * 250], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 6
    finally:
        llm.exit()


@pytest.mark.parametrize("params, error, match", [
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
])
def test_bad_sampling_params(params, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**params)


@pytest.mark.parametrize("options, error, match", [
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_seqs=65536), ValueError, r"max_num_seqs must be \[1, 65535\]"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(kvcache_block_size=48), ValueError, "power of two"),
    (dict(kvcache_block_size=8), ValueError, "kvcache_block_size"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
    (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(num_kvcache_blocks=0), ValueError, "num_kvcache_blocks"),
    (dict(max_num_seqs="4"), TypeError, "max_num_seqs"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
    (dict(num_kvcache_blocks=2, kvcache_block_size=16), ValueError, "KV cache"),
])
def test_bad_options(tiny_qwen3, options, error, match):
    with pytest.raises(error, match=match):
        LLM(tiny_qwen3, **options)


def test_bad_model_paths(tmp_path, make_checkpoint):
    with pytest.raises(ValueError, match="neither"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    import json, shutil
    path = tmp_path / "llama"
    shutil.copytree(make_checkpoint(), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(path))
