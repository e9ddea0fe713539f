"""The engine loop (engine/llm_engine.py): mixed prefill + decode steps keep running sequences going
beside long prompts; overlapped steps give exactly the results of the synchronous loop for every
sampling feature; finished requests are reported once, to whoever asked."""
import random

import pytest

from hf_reference import assert_greedy_matches_hf
from nanoinfer import LLM, SamplingParams

BS = 16


def run_hand_loop(llm, arrivals):
    """arrivals: {step: [(prompt, params), ...]} added before that step. Returns {rid: (tokens,
    finishing step)} through the public hand loop only."""
    ids, done, step = {}, {}, 0
    while arrivals or not llm.is_finished():
        for prompt, sp in arrivals.pop(step, []):
            ids[llm.add_request(prompt, sp)] = prompt
        pairs, _ = llm.step()
        step += 1
        for rid, tokens in pairs:
            done[rid] = (tokens, step)
        assert step < 2000
    return ids, done


def test_short_requests_keep_decoding_beside_a_long_prompt(tiny_qwen3):
    """The issue's example: four short requests, then an 800-token prompt arrives beside them
    (max_num_batched_tokens=128). Each short request finishes at most 2 steps later than alone, with
    the same tokens; the long prompt's tokens equal its solo run."""
    rng = random.Random(0)
    short = [([rng.randrange(300) for _ in range(12)], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
             for _ in range(4)]
    long = ([rng.randrange(300) for _ in range(800)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    options = dict(kvcache_block_size=BS, max_model_len=1024, max_num_batched_tokens=128)
    for overlap in (False, True):
        llm = LLM(tiny_qwen3, async_scheduling=overlap, **options)
        try:
            _, alone = run_hand_loop(llm, {0: list(short)})
            _, solo = run_hand_loop(llm, {0: [long]})
            ids, together = run_hand_loop(llm, {0: list(short), 2: [long]})
        finally:
            llm.exit()
        short_ids = sorted(together)[:4]
        long_id = sorted(together)[4]
        for a, t in zip(sorted(alone), short_ids):
            assert together[t][0] == alone[a][0], "a short request's tokens changed"
            assert together[t][1] <= alone[a][1] + 2, (overlap, together[t][1], alone[a][1])
        assert together[long_id][0] == next(iter(solo.values()))[0]
        assert_greedy_matches_hf(tiny_qwen3, long[0], together[long_id][0])


def random_params(rng, vocab, greedy_tokens):
    """A mix of every sampling feature whose result does not depend on the batch: greedy (with and
    without penalties), seeded sampling, stop strings, stop token ids, min_tokens, logprobs, n > 1."""
    kind = rng.choice(["greedy", "seeded", "penalty", "stop_id", "stop_str", "n", "logprobs", "min_tokens"])
    sp = dict(temperature=0, max_tokens=rng.randrange(1, 40))
    if kind == "seeded":
        sp.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1000), top_k=rng.choice([0, 20]),
                  top_p=rng.choice([1.0, 0.9]))
    elif kind == "penalty":
        sp.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    elif kind == "stop_id" and greedy_tokens:
        sp.update(stop_token_ids=[rng.choice(greedy_tokens)])
    elif kind == "stop_str":
        sp.update(stop=[rng.choice(["e", "a", "th", "in", "zz"])], include_stop_str_in_output=rng.random() < 0.5)
    elif kind == "n":
        sp.update(n=rng.choice([2, 3]), temperature=1.0, seed=rng.randrange(1000))
    elif kind == "logprobs":
        sp.update(logprobs=rng.choice([0, 3]), temperature=rng.choice([0, 1.0]), seed=rng.randrange(1000))
    elif kind == "min_tokens":
        sp.update(min_tokens=sp["max_tokens"] // 2, stop_token_ids=[rng.randrange(vocab)], seed=5, temperature=0.9)
    return SamplingParams(**sp)


def summary(out):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((k, round(v.logprob, 3)) for k, v in d.items())
                                              for d in c.logprobs]) for c in out.outputs]


@pytest.mark.parametrize("seed", range(3))
def test_overlap_equals_synchronous_on_random_workloads(tiny_qwen3, seed):
    """Random prompts (some sharing a prefix) and parameters, a pool tight enough to preempt, a small
    token budget (chunked prefill, mixed steps), arrivals between steps and aborts: overlapped and
    synchronous loops give identical outputs; greedy ones equal HF's argmax."""
    rng = random.Random(seed)
    prefix = [rng.randrange(300) for _ in range(20)]
    prompts = [(prefix if rng.random() < 0.4 else []) + [rng.randrange(300) for _ in range(rng.randrange(3, 60))]
               for _ in range(14)]
    results = {}
    for overlap in (False, True):
        llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128, num_kvcache_blocks=14,
                  max_num_batched_tokens=48, max_num_seqs=6, async_scheduling=overlap)
        try:
            base = [o["token_ids"] for o in llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=20),
                                                         use_tqdm=False)]
            prng = random.Random(seed + 100)
            params = [random_params(prng, llm.vocab_size, base[i % 4]) for i in range(len(prompts))]
            # half through generate, half by hand with arrivals between steps and two aborts
            outs = llm.generate(prompts[:7], params[:7], use_tqdm=False)
            rids, step = [], 0
            for i in range(7, 14):
                rids.append(llm.add_request(prompts[i], params[i], keep_output=True))
                llm.step()
                step += 1
                if i == 9:
                    llm.abort_request(rids[0])
            while not llm.is_finished():
                llm.step()
            hand = [llm.pop_output(rid) for rid in rids]
            bm = llm.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
            assert not llm.requests
            results[overlap] = ([summary(o) for o in outs], [summary(o) for o in hand[1:]], hand[0], llm.scheduler.num_preemptions)
        finally:
            llm.exit()
    assert results[True][:2] == results[False][:2]
    assert results[False][3] + results[True][3] > 0, "the pool should force preemption"
    for aborted in (results[True][2], results[False][2]):
        assert all(c.finish_reason in ("abort", "stop", "length") for c in aborted.outputs)
    for prompt, sp, out in zip(prompts[:7], params[:7], results[True][0]):
        if sp.temperature == 0 and not sp.presence_penalty and out[0][0]:
            assert_greedy_matches_hf(tiny_qwen3, prompt, out[0][0])


def test_generate_leaves_hand_requests_to_step(tiny_qwen3):
    """A request queued by hand progresses while generate() drives the engine, and the next step()
    reports it; generate returns only its own outputs."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        rid = llm.add_request([1, 2, 3, 4], greedy)
        outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
        assert len(outs) == 1 and len(outs[0]["token_ids"]) == 20
        pairs, num_tokens = llm.step()
        assert pairs == [(rid, llm.generate([[1, 2, 3, 4]], greedy, use_tqdm=False)[0]["token_ids"])] \
            and num_tokens == 0
        assert llm.step() == ([], 0) and llm.is_finished()
    finally:
        llm.exit()


def test_mixed_step_token_count(tiny_qwen3):
    """step() reports minus the rows of a pure decode step, the tokens of a prefill step, and every
    token (prefill chunk plus decode rows) of a mixed step."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=256, max_num_batched_tokens=40,
              async_scheduling=False)
    try:
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        llm.add_request([1, 2, 3], sp)
        assert llm.step()[1] == 3                # prefill
        assert llm.step()[1] == -1               # decode
        llm.add_request(list(range(100)), sp)
        assert llm.step()[1] == 1 + 39           # mixed: one decode row + a 39-token chunk
        assert llm.step()[1] == 1 + 39
        assert llm.step()[1] == 1 + 22           # the rest of the prompt
        assert llm.step()[1] == -2
    finally:
        llm.exit()


def failing_processor(calls: list, on_call: int):
    """A logits processor that records the output length it is called with (into `calls`) and
    raises RuntimeError("processor failed") on call number `on_call`."""
    def flaky(output_token_ids, logits):
        calls.append(len(output_token_ids))
        if len(calls) == on_call:
            raise RuntimeError("processor failed")
        return logits
    return flaky


@pytest.mark.parametrize("overlap", [True, False])
def test_an_exception_in_a_logits_processor_fails_only_its_request(tiny_qwen3, overlap):
    """A user's logits processor that raises fails its own request (finish_reason "error", its
    tokens so far kept); the other prompts of the same generate() get their exact tokens, every
    block is free afterwards, and the next generate gives the same tokens as before."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128, async_scheduling=overlap)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
        expected = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        calls = []
        bad = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             logits_processors=[failing_processor(calls, on_call=4)])
        outs = llm.generate(prompts + [[13, 14]], [greedy] * 3 + [bad], use_tqdm=False)
        assert [o["token_ids"] for o in outs[:3]] == expected
        assert outs[3].outputs[0].finish_reason == "error" and len(outs[3].outputs[0].token_ids) == 3
        bm = llm.scheduler.block_manager
        assert llm.is_finished() and not llm.requests
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
        # by hand: step() raises nothing; the failing request is reported, the others are exact
        calls.clear()
        rids = [llm.add_request(p, greedy) for p in prompts]
        bad_id = llm.add_request([13, 14], bad)
        done = {}
        while not llm.is_finished():
            done.update(llm.step()[0])
        assert [done[rid] for rid in rids] == expected and len(done[bad_id]) == 3
        assert bm.num_free_blocks == bm.num_blocks
        # sampling itself raising (as a device error would) fails the step: generate() raises, the
        # engine is left clean and serves on
        real_sample, sampled = llm.model_runner.sampler.sample, []

        def sample(*args):
            sampled.append(1)
            if len(sampled) == 4:
                raise RuntimeError("sampling failed")
            return real_sample(*args)
        llm.model_runner.sampler.sample = sample
        with pytest.raises(RuntimeError, match="sampling failed"):
            llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.is_finished() and not llm.requests
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
    finally:
        llm.exit()


def test_start_up_objects_are_frozen_for_the_cycle_collector_until_exit(tiny_qwen3):
    """What the engine made at start-up is out of the cycle collector's full scans (gc.freeze), so
    they do not stall steps; exit() unfreezes, so an exited engine's cycles are collectable."""
    import gc
    gc.unfreeze()
    llm = LLM(tiny_qwen3, max_model_len=64)
    try:
        assert gc.get_freeze_count() > 0
        model = llm.model_runner.model
        assert gc.is_tracked(model) and not any(o is model for o in gc.get_objects())  # (frozen: not listed)
        assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.exit()
    assert gc.get_freeze_count() == 0
