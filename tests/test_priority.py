"""scheduling_policy="priority": the lower value is served first, ties by arrival; memory pressure
preempts the lowest priority first; a higher-priority arrival that cannot be admitted preempts a
lower-priority running sequence; results stay exact."""
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from hf_reference import assert_greedy_matches_hf
from nanoinfer import SamplingParams
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.priority.order import order_for
from nanoinfer.step.sequence import Sequence, SequenceStatus
from test_scheduler import BS, EOS, FakeDevice, check_invariants, fake_next_token, process_step


def priority_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens=512):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=512, kvcache_block_size=BS, scheduling_policy="priority")
    return Scheduler(config, num_blocks, frozenset({EOS}), order=order_for(config))


def seq_with(prompt, priority, max_tokens):
    seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS)
    seq.priority = priority
    return seq


def drive(sched, seqs_by_step, device, on_preempt=None, max_steps=2000):
    """Run the scheduler with the fake device until every sequence finished; `seqs_by_step` maps a
    step number to the sequences that arrive before it. Returns the order in which they finished."""
    finished, step = [], 0
    pending = dict(seqs_by_step)
    while pending or not sched.is_finished():
        for seq in pending.pop(step, []):
            sched.add(seq)
        before = sched.num_preemptions
        running_before = list(sched.running)
        batch = sched.schedule()
        if sched.num_preemptions > before and on_preempt is not None:
            on_preempt([s for s in running_before if s.status == SequenceStatus.WAITING])
        if batch is not None:
            process_step(sched, batch, device.run(batch))
            finished += [s for s in batch.seqs if s.is_finished and s not in finished]
        step += 1
        assert step < max_steps
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return finished


def test_scheduler_serves_by_priority_then_arrival():
    sched = priority_scheduler(num_blocks=40, max_num_seqs=1)
    seqs = [seq_with([i + 1] * 5, p, 3) for i, p in enumerate([2, 0, 1, 0, 2])]
    order = drive(sched, {0: seqs}, FakeDevice())
    assert order == [seqs[1], seqs[3], seqs[2], seqs[0], seqs[4]]


def test_memory_pressure_preempts_the_lowest_priority_first():
    """Three sequences grow in a pool too small for all: the priority-2 one is preempted first
    (although it is not the newest), and every result equals the sequential oracle."""
    sched = priority_scheduler(num_blocks=7, max_num_seqs=3)
    prompts = [[7] * 16, [8] * 16, [9] * 16]
    seqs = [seq_with(p, prio, 30) for p, prio in zip(prompts, [1, 2, 0])]
    victims = []
    drive(sched, {0: seqs}, FakeDevice(), on_preempt=victims.append)
    assert victims and victims[0] == [seqs[1]]
    for p, seq in zip(prompts, seqs):
        assert seq.completion_token_ids == _oracle_no_eos(p, 30)


def test_a_higher_priority_arrival_preempts_a_lower_running_one():
    """max_num_seqs=1: a priority-0 request arriving while a priority-5 one decodes takes its slot
    at once and finishes first; the preempted one recomputes and its result is unchanged."""
    sched = priority_scheduler(num_blocks=40, max_num_seqs=1)
    low, high = seq_with([3, 4, 5], 5, 20), seq_with([6, 7], 0, 4)
    order = drive(sched, {0: [low], 3: [high]}, FakeDevice())
    assert order == [high, low] and sched.num_preemptions == 1
    assert low.completion_token_ids == _oracle_no_eos([3, 4, 5], 20)


def test_equal_priority_arrival_does_not_preempt():
    sched = priority_scheduler(num_blocks=40, max_num_seqs=1)
    first, second = seq_with([3, 4, 5], 1, 10), seq_with([6, 7], 1, 4)
    order = drive(sched, {0: [first], 2: [second]}, FakeDevice())
    assert order == [first, second] and sched.num_preemptions == 0


def _oracle_no_eos(prompt, max_tokens):
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(fake_next_token(ids))
        ids.append(out[-1])
    return out


# ---- through the LLM ------------------------------------------------------------------------------

def test_requests_finish_in_priority_order(tiny_qwen3, make_llm):
    llm = make_llm(tiny_qwen3, scheduling_policy="priority", max_num_seqs=1, kvcache_block_size=16, max_model_len=128)
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        prios = [3, 0, 2, 0, 1]
        rids = [llm.add_request([10 + i, 20, 30], sp, priority=p) for i, p in enumerate(prios)]
        order = []
        while not llm.is_finished():
            order += [rid for rid, _ in llm.step()[0]]
        assert order == [rids[1], rids[3], rids[4], rids[2], rids[0]]
        # generate() takes one priority per prompt and still returns outputs in prompt order
        outs = llm.generate([[5, 6, 7], [8, 9]], sp, use_tqdm=False, priority=[1, 0])
        assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9]]
        assert outs[1].metrics.finished_time <= outs[0].metrics.first_token_time
    finally:
        llm.exit()


def test_an_engine_without_the_priority_feature_serves_fifo(tiny_qwen3):
    """An LLMEngine built with no composition (no priority/ order) serves first come, first served:
    add_request's default priority 0 is taken, a non-zero one is refused."""
    engine = LLMEngine(tiny_qwen3, kvcache_block_size=16, max_model_len=64, max_num_seqs=1)
    try:
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        rids = [engine.add_request([10 + i, 20, 30], sp) for i in range(3)]
        order = []
        while not engine.is_finished():
            order += [rid for rid, _ in engine.step()[0]]
        assert order == rids
        with pytest.raises(ValueError, match="first come, first served"):
            engine.add_request([1, 2], sp, priority=1)
        assert engine.is_finished() and not engine.requests  # nothing was queued
    finally:
        engine.exit()


def test_priority_preemption_keeps_results_exact(tiny_qwen3, make_llm):
    """A tight pool with priorities: preemptions happen, greedy outputs still equal HF's."""
    llm = make_llm(tiny_qwen3, scheduling_policy="priority", kvcache_block_size=16, max_model_len=128,
                   num_kvcache_blocks=8)
    try:
        prompts = [[(7 * i + j) % 200 + 5 for j in range(20)] for i in range(4)]
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False, priority=[2, 0, 3, 1])
        assert llm.scheduler.num_preemptions > 0
        for p, out in zip(prompts, outs):
            assert_greedy_matches_hf(tiny_qwen3, p, out.outputs[0].token_ids)
        assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_blocks
    finally:
        llm.exit()


def test_bad_priority_is_a_value_error(tiny_qwen3, make_llm):
    llm = make_llm(tiny_qwen3, scheduling_policy="priority", kvcache_block_size=16, max_model_len=64)
    fcfs = make_llm(tiny_qwen3, kvcache_block_size=16, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="priority values for 2 prompts"):
            llm.generate(["a", "b"], use_tqdm=False, priority=[1])
        with pytest.raises(ValueError, match=r"priority\[1\] must be an int"):
            llm.generate(["a", "b"], use_tqdm=False, priority=[1, 1.5])
        with pytest.raises(ValueError, match="priority"):
            llm.add_request("a", priority="high")
        with pytest.raises(ValueError, match="scheduling_policy"):
            fcfs.generate(["a"], use_tqdm=False, priority=[1])
        with pytest.raises(ValueError, match="scheduling_policy"):
            make_llm(tiny_qwen3, scheduling_policy="lifo")
        assert llm.is_finished() and not llm.requests  # nothing was queued
        assert fcfs.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])[0].finished
    finally:
        llm.exit()
        fcfs.exit()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_requests=st.integers(1, 10), num_blocks=st.integers(8, 30),
       max_num_seqs=st.integers(1, 6), max_num_batched_tokens=st.integers(8, 200), overlap=st.booleans())
def test_random_priority_workloads_match_the_oracle(seed, num_requests, num_blocks, max_num_seqs,
                                                    max_num_batched_tokens, overlap):
    """Random priorities and arrivals, chunked prefill, prefix hits, both kinds of preemption, with
    and without overlapped steps: the scheduler's invariants hold every step and every output
    equals the sequential oracle."""
    rng = random.Random(seed)
    sched = priority_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens)
    shared = [rng.randrange(50) for _ in range(30)]
    pending = []
    for _ in range(num_requests):
        prompt = shared[:rng.randrange(0, 30)] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        max_tokens = rng.randrange(1, 30)
        if len(prompt) + max_tokens <= num_blocks * BS:
            pending.append(seq_with(prompt, rng.randrange(4), max_tokens))
    expected = [_oracle_no_eos(s.token_ids, s.sampling_params.max_tokens) for s in pending]
    seqs, device, inflight, steps = list(pending), FakeDevice(), None, 0
    while pending or not sched.is_finished() or inflight:
        while pending and (rng.random() < 0.4 or sched.is_finished()):
            sched.add(pending.pop(0))
        batch = sched.schedule()
        if batch is None and inflight is None and not sched.is_finished():
            batch = sched.schedule()  # a lone sequence preempted itself (as LLMEngine.advance retries)
        if batch is not None:
            check_invariants(sched, batch)
        launched = (batch, device.run(batch)) if batch is not None else None
        if inflight is not None:
            process_step(sched, *inflight)
        inflight = launched
        if not overlap and inflight is not None:
            process_step(sched, *inflight)
            inflight = None
        steps += 1
        assert steps < 5000
    assert [s.completion_token_ids for s in seqs] == expected
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
