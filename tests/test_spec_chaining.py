"""Speculative rows chained onto rows in flight (nanoinfer/speculative/chaining.py): the device's count of
accepted proposals, bonus token and shift; and, through the engine on CPU in float32, outputs equal
to plain decoding under random workloads that chain rows while others arrive, preempt, sample, run
out of max_tokens or stop mid-run, with a draft that is right about half the time."""
import os
import random
import shutil

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.speculative.chaining import chained_inputs
from nanoinfer.speculative.proposer import DeviceProposals


def test_chained_inputs_match_the_host_verification():
    rng = random.Random(0)
    for _ in range(50):
        rows, width = rng.randrange(1, 6), rng.randrange(1, 5)
        lengths = [rng.randrange(1, width + 1) for _ in range(rows)]
        queries = [[rng.randrange(5) for _ in range(1 + width)] for _ in range(rows)]
        # the step's sampling rows: a decode row first, then each speculative row's 1 + k
        sampled, first = [rng.randrange(5)], []
        for k, q in zip(lengths, queries):
            first.append(len(sampled))
            sampled += [q[j + 1] if rng.random() < 0.6 and j < k else rng.randrange(5) for j in range(k + 1)]
        prev = DeviceProposals(torch.tensor(queries), None, [10 + i for i in range(rows)], lengths,
                               first_samples=first)
        pick = rng.sample(range(rows), rng.randrange(1, rows + 1))
        last, bonus, shift = chained_inputs(prev, torch.tensor(sampled), [10 + i for i in pick])
        for j, i in enumerate(pick):
            k, q, s = lengths[i], queries[i], sampled[first[i]:first[i] + lengths[i] + 1]
            a = 0
            while a < k and s[a] == q[a + 1]:
                a += 1
            assert (last[j].item(), bonus[j].item(), shift[j].item()) == (q[a], s[a], a - k)


@pytest.fixture(scope="module")
def draft_near(tiny_qwen3, tmp_path_factory):
    """The target with noise on its weights: its greedy proposals are right about half the time."""
    from safetensors.torch import load_file, save_file
    path = str(tmp_path_factory.mktemp("near"))
    shutil.copytree(tiny_qwen3, path, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(5)
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            w = load_file(os.path.join(path, name))
            save_file({k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g) if v.ndim > 1 else v
                       for k, v in w.items()}, os.path.join(path, name))
    return path


def workload(seed: int):
    """(prompt, params, the step it arrives at) for a dozen requests: greedy ones that chain, greedy
    ones with a penalty and seeded sampled ones that propose on the host, short max_tokens, stop
    token ids."""
    rng = random.Random(seed)
    out = []
    for i in range(12):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))]
        kind = rng.choice(["argmax", "argmax", "argmax", "penalty", "sampled"])
        max_tokens = rng.choice([1, 2, 5, rng.randrange(3, 40)])
        extra = {"stop_token_ids": [rng.randrange(3, 300) for _ in range(20)]} if rng.random() < 0.3 else {}
        if kind == "argmax":
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)
        elif kind == "penalty":
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.3)
        else:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, **extra)
        out.append((prompt, params, rng.choice([0, 0, 0, rng.randrange(1, 30)])))
    return out


def drive(llm: LLM, requests) -> list:
    """Add each request at its step, step to the end; every request's (tokens, finish reason)."""
    rids, step = {}, 0
    while len(rids) < len(requests) or not llm.is_finished():
        for i, (prompt, params, at) in enumerate(requests):
            if i not in rids and at <= step:
                rids[i] = llm.add_request(prompt, params, keep_output=True)
        llm.step()
        step += 1
        assert step < 2000
    outs = [llm.pop_output(rids[i]).outputs[0] for i in range(len(requests))]
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.mark.parametrize("pool", [None, 6])
def test_chained_rows_give_plain_decoding_under_random_workloads(tiny_qwen3, draft_near, pool):
    options = dict(kvcache_block_size=16, max_model_len=96, max_num_batched_tokens=48, num_kvcache_blocks=pool)
    chained = preempted = 0
    for seed in range(4):
        requests = workload(seed)
        plain = LLM(tiny_qwen3, **options)
        expected = drive(plain, requests)
        plain.exit()
        llm = LLM(tiny_qwen3, **options, speculative_config={"model": draft_near, "num_speculative_tokens": 3})
        try:
            assert drive(llm, requests) == expected, f"seed {seed}"
            bm = llm.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
            stats = llm.spec_stats
            assert 0.2 < stats.acceptance_rate < 0.8
            chained += llm.rows.speculator.num_chained
            preempted += llm.scheduler.num_preemptions
        finally:
            llm.exit()
    assert chained > (10 if pool else 40)
    if pool is not None:
        assert preempted > 0


def test_a_step_undone_after_the_step_it_chained_onto_was_processed(tiny_qwen3, draft_near):
    """Sampling that raises in a step with a logits processor beside a structured request (its
    masks sample eagerly): the step is undone after the one before it was processed, and a chained
    row's progress is given back by its length. The engine keeps serving: the greedy request then
    ends as plain decoding does. (A raising logits processor fails only its own request now: the
    sampler itself raises here, as a device error would.)"""
    from nanoinfer import StructuredOutputsParams
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    structured = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = [11, 12, 13, 14, 15]
    plain = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256)
    expected = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    plain.exit()
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256,
              speculative_config={"model": draft_near, "num_speculative_tokens": 3})
    raised = 0
    real_sample = llm.model_runner.sampler.sample
    try:
        for on_call in range(2, 8):
            calls = []

            def failing(out, logits, calls=calls, on_call=on_call):
                calls.append(len(out))
                if len(calls) == on_call:
                    raise_in_sampling.append(True)
                return logits

            def sample(step, sample, args, logits):  # raises in the step whose processor asked
                sampled = real_sample(step, sample, args, logits)
                if raise_in_sampling:
                    raise_in_sampling.clear()
                    raise RuntimeError("processor failed")
                return sampled
            raise_in_sampling = []
            llm.model_runner.sampler.sample = sample
            ra = llm.add_request(prompt, greedy, keep_output=True)
            rb = llm.add_request("Hello, my name is", structured, keep_output=True)
            rc = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                           logits_processors=[failing]))
            try:
                while not llm.is_finished():
                    llm.step()
            except RuntimeError as e:
                assert "processor failed" in str(e)
                raised += 1
            llm.abort_request(rc)
            for _ in range(300):
                if llm.is_finished():
                    break
                llm.step()
            assert llm.pop_output(ra).outputs[0].token_ids == expected, f"on call {on_call}"
            llm.pop_output(rb)
        assert raised == 6 and llm.rows.speculator.num_chained > 0
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.exit()


def test_rows_that_cannot_chain_keep_their_proposals(tiny_qwen3):
    """With no room for a chained step (max_num_seqs 2, both running), the sequence with a row in
    flight waits and the other still scores all k proposals (a draft equal to its target accepts
    them): each row but a sequence's last ones scores 3."""
    prompts = [[5, 6, 7, 8] * 8, [9, 10, 11, 12, 13] * 6]
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, max_num_seqs=2,
              speculative_config={"model": tiny_qwen3, "num_speculative_tokens": 3})
    try:
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        llm.add_request(prompts[0], params)
        llm.step()
        llm.add_request(prompts[1], params)
        while not llm.is_finished():
            llm.step()
        stats = llm.spec_stats
        assert stats.num_draft_tokens == stats.num_accepted_tokens
        assert stats.num_draft_tokens >= 3 * (stats.num_drafts - 2 * 2)  # (near max_tokens: fewer)
        assert stats.num_drafts <= 2 * (60 // 4 + 2)
    finally:
        llm.exit()
