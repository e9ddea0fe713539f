"""Scheduler invariants under random workloads, driven by a fake model whose next token is a
function of the whole token history (so results must not depend on batching or preemption)."""
import random
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st
import xxhash

from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence, SequenceStatus
from nanoinfer.sampling_params import SamplingParams

BS = 16
EOS = 3


def fake_next_token(token_ids):
    return xxhash.xxh32(str(token_ids).encode()).intdigest() % 50


def make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len=256):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, eos_token_ids=(EOS,), kvcache_block_size=BS)
    return Scheduler(config, num_blocks)


def check_invariants(sched: Scheduler, batch, is_prefill):
    bm = sched.block_manager
    assert batch, "schedule returned an empty batch while work remained"
    assert len(batch) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    if is_prefill:
        assert sum(s.num_scheduled_tokens for s in batch) <= sched.max_num_batched_tokens
        for s in batch:
            assert s.num_scheduled_tokens >= 1, "zero-length prefill"
            assert s.num_computed_tokens + s.num_scheduled_tokens <= len(s)
    else:
        for s in batch:
            assert s.num_scheduled_tokens == 1 and s.num_computed_tokens == len(s) - 1
    holders = {}
    for s in list(sched.running) + [w for w in sched.waiting if w.block_table]:
        assert len(s.block_table) >= (s.num_computed_tokens + s.num_scheduled_tokens + BS - 1) // BS
        for b in s.block_table:
            holders[b] = holders.get(b, 0) + 1
    for s in sched.waiting:
        if s is not (sched.waiting[0] if sched.waiting else None):
            assert not s.block_table, "only the head of the queue may hold blocks while waiting"
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        if block.ref_count > 1:
            assert block.hash is not None, "only cached full blocks are shared"
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)


def run_workload(requests, num_blocks, max_num_seqs, max_num_batched_tokens, rng=None):
    sched = make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens)
    seqs = []
    pending = list(requests)
    steps = 0
    while pending or not sched.is_finished():
        # random arrivals between steps
        while pending and (rng is None or rng.random() < 0.5 or sched.is_finished()):
            prompt, max_tokens = pending.pop(0)
            seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), BS)
            seqs.append(seq)
            sched.add(seq)
        batch, is_prefill = sched.schedule()
        check_invariants(sched, batch, is_prefill)
        tokens = [fake_next_token(s.token_ids) for s in batch]
        sched.postprocess(batch, tokens, is_prefill)
        steps += 1
        assert steps < 10_000
    bm = sched.block_manager
    assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_blocks
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    return [s.completion_token_ids for s in seqs], sched


def oracle(prompt, max_tokens):
    out, ids = [], list(prompt)
    while len(out) < max_tokens:
        t = fake_next_token(ids)
        out.append(t)
        ids.append(t)
        if t == EOS:
            break
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_requests=st.integers(1, 12), num_blocks=st.integers(8, 40),
       max_num_seqs=st.integers(1, 8), max_num_batched_tokens=st.integers(8, 300))
def test_random_workloads_match_oracle(seed, num_requests, num_blocks, max_num_seqs, max_num_batched_tokens):
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(40)]
    requests = []
    for _ in range(num_requests):
        prompt = shared[:rng.randrange(0, 40)] + [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
        max_tokens = rng.randrange(1, 40)
        if len(prompt) + max_tokens > num_blocks * BS:  # the engine rejects these at add_request
            continue
        requests.append((prompt, max_tokens))
    if not requests:
        return
    outputs, _ = run_workload(requests, num_blocks, max_num_seqs, max_num_batched_tokens, rng)
    assert outputs == [oracle(p, m) for p, m in requests]


def test_preemption_happens_and_keeps_results():
    rng = random.Random(0)
    requests = [([rng.randrange(50) for _ in range(20)], 60) for _ in range(6)]
    outputs, sched = run_workload(requests, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=512)
    assert sched.num_preemptions > 0
    assert outputs == [oracle(p, m) for p, m in requests]


def test_long_prompt_is_chunked():
    sched = make_scheduler(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32)
    seq = Sequence(list(range(100)), SamplingParams(max_tokens=2), BS)
    sched.add(seq)
    chunks = []
    while seq.num_completion_tokens == 0:
        batch, is_prefill = sched.schedule()
        assert is_prefill and batch == [seq]
        chunks.append(seq.num_scheduled_tokens)
        sched.postprocess(batch, [7], True)
    assert chunks == [32, 32, 32, 4]
    assert seq.completion_token_ids == [7]


def test_prefix_cache_hit_across_requests():
    sched = make_scheduler(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=512)
    prompt = list(range(40))
    a = Sequence(prompt, SamplingParams(max_tokens=1), BS)
    sched.add(a)
    batch, is_prefill = sched.schedule()
    sched.postprocess(batch, [5], is_prefill)
    b = Sequence(prompt + [1, 2], SamplingParams(max_tokens=1), BS)
    sched.add(b)
    batch, is_prefill = sched.schedule()
    assert is_prefill and b.num_cached_tokens == 32 and b.num_scheduled_tokens == 10
