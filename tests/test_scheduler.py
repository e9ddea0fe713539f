"""Scheduler invariants under random workloads, driven by a fake model whose next token is a
function of the whole token history (so results must not depend on batching or preemption)."""
import random
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st
import xxhash

from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.step.sequence import Sequence, SequenceStatus
from nanoinfer.sampling_params import SamplingParams

BS = 16
EOS = 3


def process_step(sched, batch, tokens):
    """A step's tokens as the engine processes them without stop strings: update, then the finishes."""
    sched.finish_rows(batch, sched.update(batch, tokens), {})


def fake_next_token(token_ids):
    return xxhash.xxh32(str(token_ids).encode()).intdigest() % 50


def make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len=256):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, kvcache_block_size=BS)
    return Scheduler(config, num_blocks, frozenset({EOS}))


def check_invariants(sched: Scheduler, batch):
    bm = sched.block_manager
    assert batch is not None and batch.seqs, "schedule returned an empty batch while work remained"
    assert len(batch.seqs) <= sched.max_num_seqs and len(set(map(id, batch.seqs))) == len(batch.seqs)
    assert len(sched.running) <= sched.max_num_seqs
    assert sum(batch.query_lens) <= sched.max_num_batched_tokens
    assert all(q == 1 for q in batch.query_lens[:batch.num_decode]), "decode rows come first"
    for seq, start, q in zip(batch.seqs, batch.starts, batch.query_lens):
        assert q >= 1, "zero-length row"
        assert start + q <= seq.num_tokens + seq.num_inflight and start + q <= seq.num_computed_tokens
        assert len(seq.block_table) * BS >= start + q, "the block table must cover the row"
    holders = {}
    for s in sched.running:
        assert len(s.block_table) * BS >= s.num_computed_tokens
        for b in s.block_table:
            holders[b] = holders.get(b, 0) + 1
    for s in sched.waiting:
        assert not s.block_table, "a waiting sequence holds no blocks"
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        if block.ref_count > 1:
            assert block.hash is not None, "only cached full blocks are shared"
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)


class FakeDevice:
    """Samples fake_next_token over each row's context. It knows the tokens it sampled before the
    host has appended them, as the GPU does with overlapped steps."""

    def __init__(self):
        self.history = {}  # seq_id -> every token up to the newest sampled

    def run(self, batch):
        tokens = []
        for seq, start, q, samples in zip(batch.seqs, batch.starts, batch.query_lens, batch.samples):
            hist = self.history.setdefault(seq.seq_id, list(seq.token_ids))
            assert hist[:len(seq.token_ids)] == seq.token_ids
            token = fake_next_token(hist[:start + q])
            if samples and start + q == len(hist):
                hist.append(token)
            tokens.append(token)
        return tokens


def run_workload(requests, num_blocks, max_num_seqs, max_num_batched_tokens, rng=None, overlap=False):
    """The engine loop with a fake model: schedule step N+1, then (overlap) process step N."""
    sched = make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens)
    device = FakeDevice()
    seqs = []
    pending = list(requests)
    inflight = None
    steps = 0
    while pending or not sched.is_finished() or inflight:
        # random arrivals between steps
        while pending and (rng is None or rng.random() < 0.5 or sched.is_finished()):
            prompt, max_tokens = pending.pop(0)
            seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), BS)
            seqs.append(seq)
            sched.add(seq)
        batch = sched.schedule()
        if batch is None and inflight is None and not sched.is_finished():
            batch = sched.schedule()  # a lone sequence preempted itself (as LLMEngine.advance retries)
        if batch is not None:
            check_invariants(sched, batch)
            launched = (batch, device.run(batch))
        else:
            assert inflight is not None or sched.is_finished(), "no progress"
            launched = None
        if inflight is not None:
            process_step(sched, *inflight)
        inflight = launched
        if not overlap and inflight is not None:
            process_step(sched, *inflight)
            inflight = None
        steps += 1
        assert steps < 10_000
    bm = sched.block_manager
    assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_blocks
    assert all(s.status == SequenceStatus.FINISHED and not s.num_inflight for s in seqs)
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
    """Arrivals at random steps, EOS stops, chunked prefill, prefix hits and preemption, with and
    without overlapped steps: every output equals the sequential oracle."""
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
    expected = [oracle(p, m) for p, m in requests]
    for overlap in (False, True):
        outputs, _ = run_workload(requests, num_blocks, max_num_seqs, max_num_batched_tokens,
                                  random.Random(seed), overlap)
        assert outputs == expected


def test_preemption_happens_and_keeps_results():
    rng = random.Random(0)
    requests = [([rng.randrange(50) for _ in range(20)], 60) for _ in range(6)]
    for overlap in (False, True):
        outputs, sched = run_workload(requests, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=512,
                                      overlap=overlap)
        assert sched.num_preemptions > 0
        assert outputs == [oracle(p, m) for p, m in requests]


def test_long_prompt_is_chunked():
    sched = make_scheduler(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32)
    seq = Sequence(list(range(100)), SamplingParams(max_tokens=2), BS)
    sched.add(seq)
    chunks = []
    while seq.num_completion_tokens == 0:
        batch = sched.schedule()
        assert batch.seqs == [seq] and batch.num_decode == 0
        chunks.append(batch.query_lens[0])
        process_step(sched, batch, [7])
    assert chunks == [32, 32, 32, 4]
    assert seq.completion_token_ids == [7]


def test_running_sequences_decode_beside_a_long_prompt():
    """Mixed batches: every running sequence gets its decode token in every step while a long
    prompt is prefilled in chunks from what is left of the token budget."""
    sched = make_scheduler(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=32)
    short = [Sequence([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), BS) for _ in range(4)]
    for s in short:
        sched.add(s)
    process_step(sched, sched.schedule(), [5] * 4)  # their prompts: one step
    long = Sequence(list(range(200)), SamplingParams(max_tokens=2, ignore_eos=True), BS)
    sched.add(long)
    chunks = []
    while long.num_completion_tokens == 0:
        batch = sched.schedule()
        assert batch.seqs[:4] == short and batch.num_decode == 4, "every running sequence decodes"
        assert batch.seqs[4:] == [long]
        chunks.append(batch.query_lens[4])
        process_step(sched, batch, [5] * 5)
    assert chunks == [28] * 7 + [4] and sum(chunks) == 200
    assert all(s.num_completion_tokens == 1 + len(chunks) for s in short)


def test_several_prompts_mid_prefill():
    sched = make_scheduler(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = (Sequence(list(range(n)), SamplingParams(max_tokens=1), BS) for n in (50, 90))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.query_lens == [50, 14]
    process_step(sched, batch, [0, 0])
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.query_lens == [64]


def test_prefix_cache_hit_across_requests():
    sched = make_scheduler(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=512)
    prompt = list(range(40))
    a = Sequence(prompt, SamplingParams(max_tokens=1), BS)
    sched.add(a)
    process_step(sched, sched.schedule(), [5])
    b = Sequence(prompt + [1, 2], SamplingParams(max_tokens=1), BS)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [b] and b.num_cached_tokens == 32 and batch.starts == [32] and batch.query_lens == [10]
