"""Speculative decoding through the engine (nanoinfer/speculative), on CPU in float32: with every
proposer, greedy output equals plain decoding token for token (and HF's argmax), whatever ends a
run (stop strings, stop ids, EOS, max_tokens), with a tight pool, chunked prefill, overlap on and
off and mixed batches; seeded sampling with every sampling feature gives the same tokens and
logprobs as without speculation; the counters and the policy."""
import random

import pytest

from hf_reference import assert_greedy_matches_hf
from nanoinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repeating_prompts(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a pattern (n-gram lookup finds proposals) and random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pattern = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 8))]
        out.append(pattern * rng.randrange(2, 5) if i % 3 else [rng.randrange(3, vocab) for _ in range(20)])
    return out


def run(path, prompts, params, **options) -> tuple[list, LLM]:
    llm = LLM(path, kvcache_block_size=16, max_model_len=256, **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.is_finished()
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    finally:
        llm.exit()
    return outs, llm


def tokens(outs):
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module")
def draft_other(make_checkpoint):
    """Another random model with the same vocabulary: its proposals are (almost) always rejected."""
    return make_checkpoint(seed=1, num_layers=1)


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    prompts = repeating_prompts(300)
    outs, _ = run(tiny_qwen3, prompts, GREEDY)
    for p, o in zip(prompts, tokens(outs)):
        assert_greedy_matches_hf(tiny_qwen3, p, o)
    return prompts, tokens(outs)


def proposers(tiny_qwen3, draft_other):
    return {"ngram": NGRAM, "draft_same": {"model": tiny_qwen3, "num_speculative_tokens": 3},
            "draft_other": {"model": draft_other, "num_speculative_tokens": 4}}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", ["ngram", "draft_same", "draft_other"])
def test_greedy_output_equals_plain_decoding(tiny_qwen3, draft_other, reference, name, overlap):
    prompts, expected = reference
    spec = proposers(tiny_qwen3, draft_other)[name]
    outs, llm = run(tiny_qwen3, prompts, GREEDY, speculative_config=spec, async_scheduling=overlap)
    assert tokens(outs) == expected
    stats = llm.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    # overlapped, a draft's rows chain onto the ones in flight (speculative/chaining.py)
    assert (llm.rows.speculator.num_chained > 0) == (overlap and name != "ngram")
    if name == "draft_same":  # every proposal accepted, at every position
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.accepted_per_position[0] == stats.num_drafts
    elif name == "draft_other":
        assert stats.acceptance_rate < 0.5
    else:  # repeating prompts: lookup proposes what the model repeats
        assert stats.num_accepted_tokens > 0


def test_runs_end_where_plain_decoding_ends(tiny_qwen3, reference):
    """Stop token ids, EOS, stop strings and max_tokens that fall inside accepted runs (a draft
    equal to the target accepts whole runs), and min_tokens holding a stop back: the same outputs,
    text and finish reasons as without speculation."""
    prompts, expected = reference
    rng = random.Random(1)
    params = []
    for i, e in enumerate(expected):
        j = rng.randrange(2, 20)
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=j, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[e[j]], min_tokens=j // 2))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    spec = {"model": tiny_qwen3, "num_speculative_tokens": 4}
    plain_llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256)
    texts = [o.outputs[0].text for o in plain_llm.generate(prompts, GREEDY, use_tqdm=False)]
    plain_llm.exit()
    for i, t in enumerate(texts):  # stop strings: a piece of the completion's text
        if i % 3 == 2 and len(t) > 6:
            piece = t[len(t) // 2:len(t) // 2 + 2]
            params[i] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[piece])
    results = {}
    for options in ({}, {"speculative_config": spec}):
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, **options)
        # EOS: a token of the first completion (mid-run) treated as EOS, in both engines
        eos = frozenset({expected[0][5]})
        llm.scheduler.eos_token_ids = llm.step_encoder.eos_token_ids = eos
        params[0] = SamplingParams(temperature=0, max_tokens=24)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[bool(options)] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                   o.outputs[0].stop_reason) for o in outs]
        if options:
            assert llm.spec_stats.num_accepted_tokens == llm.spec_stats.num_draft_tokens > 0
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        llm.exit()
    assert results[True] == results[False]
    reasons = [r[2] for r in results[True]]
    assert "length" in reasons and "stop" in reasons
    end = expected[0].index(expected[0][5]) + 1
    assert end > 1 and results[True][0][0] == expected[0][:end]  # ended on the EOS token, after the prefill's


@pytest.mark.parametrize("name", ["ngram", "draft_same"])
def test_tight_pool_and_chunked_prefill(tiny_qwen3, draft_other, reference, name):
    """Preemption (the draft's KV starts over) and prompts in chunks: the same greedy output; a
    draft's catch-up over a prompt or a preempted sequence runs in chunks of the token budget too."""
    prompts, expected = reference
    spec = proposers(tiny_qwen3, draft_other)[name]
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=10,
              max_num_batched_tokens=24, speculative_config=spec)
    sizes = []
    runner = getattr(llm.rows.speculator.proposer, "runner", None)
    if runner is not None:
        launch = runner.launch
        runner.launch = lambda step, *a: (sizes.append(sum(step.query_lens)), launch(step, *a))[1]
    try:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.scheduler.num_preemptions > 0 and llm.spec_stats.num_drafts > 0
        if runner is not None:
            assert sizes and max(sizes) <= 24, f"a draft forward of {max(sizes)} tokens"
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    finally:
        llm.exit()


def test_mixed_batch_with_requests_that_get_no_proposals(tiny_qwen3, reference):
    """A request with a logits processor needs its tokens on the host: it gets no proposals and
    decodes beside speculative rows; everyone's output equals plain decoding."""
    prompts, expected = reference
    calls = []

    def identity(token_ids, logits):
        calls.append(len(token_ids))
        return logits

    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             logits_processors=[identity] if i % 2 else None) for i in range(len(prompts))]
    outs, llm = run(tiny_qwen3, prompts, params, speculative_config=NGRAM)
    assert tokens(outs) == expected
    assert llm.spec_stats.num_drafts > 0
    assert sorted(calls) == sorted(n for i in range(1, len(prompts), 2) for n in range(24))  # one call per token


@pytest.mark.parametrize("name", ["ngram", "draft_same"])
def test_sampling_features_are_exact(tiny_qwen3, draft_other, reference, name):
    """Seeded sampling keys its noise by the token's position in the completion, so speculation
    (which verifies each position with the options it would have had) gives the same tokens and
    logprobs: temperature, top-k/p, min-p, penalties, min_tokens, bad words, logit bias, n > 1."""
    prompts, _ = reference
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=20, logprobs=3),
              SamplingParams(temperature=1.0, min_p=0.05, seed=8, max_tokens=20, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2),
              SamplingParams(temperature=0.7, seed=9, max_tokens=20, min_tokens=10, logprobs=2),
              SamplingParams(temperature=0.9, seed=10, max_tokens=20, bad_words=["a"], logit_bias={5: 3.0}),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, logprobs=1),
              SamplingParams(temperature=0.2, seed=11, max_tokens=20, ignore_eos=True, n=2)]
    spec = proposers(tiny_qwen3, draft_other)[name]
    plain, _ = run(tiny_qwen3, prompts, params)
    outs, llm = run(tiny_qwen3, prompts, params, speculative_config=spec)
    assert llm.spec_stats.num_drafts > 0
    if name == "draft_same":  # it samples with each request's options and seeded noise: the target's samples
        assert llm.spec_stats.acceptance_rate > 0.9
    for ca, cb in ((ca, cb) for a, b in zip(plain, outs) for ca, cb in zip(a.outputs, b.outputs, strict=True)):
        assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
        if ca.logprobs is not None:
            assert len(cb.logprobs) == len(cb.token_ids)
            for da, db in zip(ca.logprobs, cb.logprobs):
                assert da.keys() == db.keys()
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank for t in da)
            assert abs(ca.cumulative_logprob - cb.cumulative_logprob) < 1e-3


def test_policy_turns_speculation_off(tiny_qwen3, draft_other, reference):
    prompts, expected = reference
    # more sequences running than disable_by_batch_size: no proposals (they all finish together)
    outs, llm = run(tiny_qwen3, prompts, GREEDY, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert tokens(outs) == expected and llm.spec_stats.num_drafts == 0
    # a draft that is always wrong: each sequence is judged on its first proposals, then decodes plainly
    spec = {"model": draft_other, "num_speculative_tokens": 4, "disable_below_acceptance": 0.5}
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs, llm = run(tiny_qwen3, prompts, params, speculative_config=spec)
    plain, _ = run(tiny_qwen3, prompts, params)
    assert tokens(outs) == tokens(plain)
    assert 0 < llm.spec_stats.num_draft_tokens <= len(prompts) * (16 + 4)


def test_metrics_and_streaming(tiny_qwen3, reference):
    prompts, expected = reference
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, speculative_config=NGRAM)
    try:
        deltas = list(llm.stream(prompts[:3], GREEDY))
        streamed = {}
        for d in deltas:
            streamed.setdefault(d.request_id, []).extend(d.token_ids)
        assert sorted(streamed.values()) == sorted(expected[:3])
        metrics = {m.name: m.value for m in llm.get_metrics()}
        s = llm.spec_stats
        assert metrics["nanoinfer:spec_decode_num_drafts"] == s.num_drafts > 0
        assert metrics["nanoinfer:spec_decode_num_draft_tokens"] == s.num_draft_tokens
        assert metrics["nanoinfer:spec_decode_num_accepted_tokens"] == s.num_accepted_tokens
    finally:
        llm.exit()


@pytest.mark.timeout(180)
def test_ngram_with_tensor_parallel(tiny_qwen3, reference):
    """Every rank computes the speculative rows' logits; rank 0 verifies: tp=2 equals tp=1."""
    prompts, expected = reference
    outs, llm = run(tiny_qwen3, prompts[:4], GREEDY, speculative_config=NGRAM, tensor_parallel_size=2)
    assert tokens(outs) == expected[:4] and llm.spec_stats.num_accepted_tokens > 0


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", ["ngram", "draft_same", "draft_other"])
def test_cuda_graphs_and_kernels_keep_greedy_output(make_checkpoint, make_llm, name, overlap):
    """On CUDA (Triton attention, CUDA graphs for the draft's decode steps and the mixed steps that
    verify), float32: every greedy token is HF's teacher-forced argmax, and a draft equal to its
    target accepts (nearly) every proposal."""
    small = dict(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128)
    path, other = make_checkpoint(**small), make_checkpoint(seed=1, num_layers=1, **small)
    spec = proposers(path, other)[name]
    llm = make_llm(path, dtype="float32", kvcache_block_size=16, max_model_len=512, max_num_seqs=16,
                   max_num_batched_tokens=128, speculative_config=spec, async_scheduling=overlap)
    try:
        prompts = repeating_prompts(llm.vocab_size, n=9, seed=4)
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = tokens(llm.generate(prompts, sp, use_tqdm=False))
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(path, p, o, tol=1e-3)
        assert llm.spec_stats.num_drafts > 0
        if name == "draft_same":
            assert llm.spec_stats.acceptance_rate > 0.95
        assert llm.model_runner.info()["cuda_graphs"]
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.exit()


def test_adapters_structured_outputs_and_prompt_logprobs_beside_speculative_rows(tiny_qwen3, tmp_path):
    """LoRA rows speculate under their adapter; a structured-output request gets no proposals; a
    prompt_logprobs request's prompt positions are computed in the same steps: all as without."""
    from lora_reference import make_adapter
    from nanoinfer import LoRARequest
    from nanoinfer.sampling_params import StructuredOutputsParams
    adapter = LoRARequest("a", 1, make_adapter(tiny_qwen3, str(tmp_path / "adapter")))
    rng = random.Random(5)
    pattern = [rng.randrange(3, 300) for _ in range(6)]
    prompts = [pattern * 3, pattern * 2, [rng.randrange(3, 300) for _ in range(20)], pattern * 4]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)]
    results = {}
    for spec in (None, NGRAM):
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, enable_lora=True, max_lora_rank=8,
                  speculative_config=spec)
        try:
            outs = llm.generate(prompts, params, lora_request=[None, adapter, None, adapter], use_tqdm=False)
            if spec:
                assert llm.spec_stats.num_accepted_tokens > 0
        finally:
            llm.exit()
        results[spec is None] = outs
    for a, b in zip(results[True], results[False]):
        assert (a.outputs[0].token_ids, a.outputs[0].text) == (b.outputs[0].token_ids, b.outputs[0].text)
        for la, lb in ((a.prompt_logprobs or [])[1:], (b.prompt_logprobs or [])[1:]), \
                      (a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert len(la) == len(lb)
            for da, db in zip(la, lb):
                assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da)
    assert results[True][0].prompt_logprobs and results[True][3].outputs[0].logprobs
