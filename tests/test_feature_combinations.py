"""Where the engine's features meet (offline API). Two kinds of differential test:

- the scheduler with a fake device that keeps K/V: each computed position's token is written into
  the block it maps to, and every position a row attends to is read back from the blocks, so a
  row that reads K/V no step wrote (a prefix-cache hit on a block registered too early, a rejected
  proposal's slot) samples a wrong token. Random workloads mix priorities, arrivals, aborts,
  n > 1, EOS, chunked prefill, prefix sharing, tight pools and speculative rows, overlapped or not;
  outputs must equal the sequential oracle, every registered block must hold its tokens' K/V after
  every step, and every block is free at the end;
- the real engine (tiny random model, CPU float32): the same greedy / seeded requests with features
  on (speculative decoding, LoRA, priority, a tight pool, chunked prefill, overlap, aborts, images)
  give exactly the tokens, text, finish reasons and logprobs of a plain, roomy engine.

And the combinations that are refused are refused at construction, with a ValueError naming them.
"""
import random
from types import SimpleNamespace

import pytest
import torch
import xxhash

from nanoinfer.multimodal.feature import ImageRankFeature
from nanoinfer.multimodal.feature import ImageFeature
from nanoinfer.speculative.row_planner import SpeculativeRows
from nanoinfer import LLM, LoRARequest, PoolingParams, SamplingParams
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.priority.order import order_for
from nanoinfer.step.sequence import Sequence, SequenceStatus
from nanoinfer.step.step_message import StepResult
from nanoinfer.speculative.config import SpeculativeConfig
from nanoinfer.speculative.speculator import Speculator

from test_spec_scheduling import FakeProposer  # proposes the fake model's tokens (same next_token), one wrong

BS = 16
EOS = 3


# ---- the scheduler with a fake device that keeps K/V ---------------------------------------------
def next_token(context) -> int:
    """The fake model: a function of the whole context (None where a position's K/V is missing)."""
    return xxhash.xxh32(str(context).encode()).intdigest() % 50


class KVDevice:
    """Runs a scheduled batch at launch (device order is launch order). kv[block][slot] is the
    (token, position) whose K/V the slot holds. history: per sequence, its tokens including those
    sampled by launched steps the host has not appended yet."""

    def __init__(self, num_blocks: int):
        self.kv = [[None] * BS for _ in range(num_blocks)]
        self.history: dict[int, list[int]] = {}

    def _history(self, seq) -> list[int]:
        hist = self.history.get(seq.seq_id)
        if hist is None or hist[:seq.num_tokens] != seq.token_ids:  # (after a speculative row: the host's run)
            hist = self.history[seq.seq_id] = list(seq.token_ids)
        return hist

    def run(self, batch) -> list[int]:
        inputs = []
        for row, (seq, start, q) in enumerate(zip(batch.seqs, batch.starts, batch.query_lens)):
            hist = self._history(seq)
            draft = batch.drafts.get(row)
            tokens = hist[start:start + q] if draft is None else [hist[start]] + draft
            assert len(tokens) == q
            inputs.append(tokens)
            for p, t in zip(range(start, start + q), tokens):  # a layer stores every row's K/V first
                assert len(seq.block_table) * BS > p, "the row's block table does not cover it"
                self.kv[seq.block_table[p // BS]][p % BS] = (t, p)
        out = []
        for row, (seq, start, q, samples) in enumerate(zip(batch.seqs, batch.starts, batch.query_lens, batch.samples)):
            positions = range(start + q - 1, start + q) if row not in batch.drafts else range(start, start + q)
            for end in positions:  # a speculative row samples at every query position
                context = [self._read(seq, p) for p in range(end + 1)]
                out.append(next_token(context))
            if samples and row not in batch.drafts and start + q == len(self.history[seq.seq_id]):
                self.history[seq.seq_id].append(out[-1])
        return out

    def _read(self, seq, p):
        entry = self.kv[seq.block_table[p // BS]][p % BS]
        return entry[0] if entry is not None and entry[1] == p else None

    def check_registered_blocks(self, bm):
        """Every block in the prefix cache holds the K/V of its tokens (a later hit reads them)."""
        for block_id in bm.hash_to_block.values():
            block = bm.blocks[block_id]
            for j, t in enumerate(block.token_ids):
                entry = self.kv[block_id][j]
                assert entry is not None and entry[0] == t and entry[1] % BS == j, \
                    f"block {block_id} is in the prefix cache but slot {j} holds {entry}, not token {t}"


def oracle(prompt, sp) -> list[int]:
    ids, out = list(prompt), []
    while len(out) < sp.max_tokens:
        out.append(next_token(ids))
        ids.append(out[-1])
        if out[-1] == EOS and not sp.ignore_eos:
            break
    return out


def make_scheduler(num_blocks, max_num_seqs, budget, policy="fcfs", max_model_len=512, prefix_caching=True):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                             kvcache_block_size=BS, scheduling_policy=policy)
    return Scheduler(config, num_blocks, frozenset({EOS}), prefix_caching, order=order_for(config))


class Loop:
    """LLMEngine._advance with the KV device: schedule (and propose), launch, process the step
    before (overlap) or this one."""

    def __init__(self, sched, device, speculator=None, overlap=True):
        self.sched, self.device, self.speculator, self.overlap = sched, device, speculator, overlap
        if speculator is not None:
            sched.rows = SpeculativeRows(speculator)
        self.inflight = None

    def step(self):
        sched = self.sched
        batch = sched.schedule()
        if batch is None and self.inflight is None and not sched.is_finished():
            batch = sched.schedule()  # a lone sequence preempted itself
        launched = None
        if batch is not None:
            if batch.drafts:
                self.speculator.propose(batch)
            launched = (batch, self.device.run(batch))
        prev, self.inflight = self.inflight, launched
        if prev is not None:
            self.process(*prev)
        if launched is not None and not self.overlap:
            self.inflight = None
            self.process(*launched)
        self.device.check_registered_blocks(sched.block_manager)
        return batch

    def process(self, batch, tokens):
        runs = None
        if batch.drafts:
            tokens, runs, _ = self.speculator.verify(batch, StepResult(tokens))
        self.sched.finish_rows(batch, self.sched.update(batch, tokens, runs), {})


def run_random_workload(seed: int):
    rng = random.Random(seed)
    num_blocks = rng.randrange(6, 30)
    policy = rng.choice(["fcfs", "priority", "priority"])
    sched = make_scheduler(num_blocks, rng.randrange(1, 8), rng.randrange(8, 60), policy,
                           prefix_caching=rng.random() < 0.85)
    speculator = None
    if rng.random() < 0.5:
        speculator = Speculator(SpeculativeConfig("ngram", rng.randrange(1, 5)), 512, FakeProposer(rng))
    loop = Loop(sched, KVDevice(num_blocks), speculator, overlap=rng.random() < 0.7)
    shared = [rng.randrange(4, 50) for _ in range(64)]
    pending = []
    for _ in range(rng.randrange(2, 12)):
        prompt = shared[:rng.choice([0, 16, 32, 48, 64, 64, rng.randrange(64)])] + \
            [rng.randrange(4, 50) for _ in range(rng.randrange(1, 50))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=rng.random() < 0.7)
        if len(prompt) + sp.max_tokens > num_blocks * BS:
            continue  # (the engine refuses these at intake)
        samples = [Sequence(prompt, sp, BS) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        for s in samples:
            s.priority = rng.randrange(4) if policy == "priority" else 0
        pending.append(samples)
    requests, aborted, steps = [], set(), 0
    while pending or not sched.is_finished() or loop.inflight:
        while pending and (rng.random() < 0.3 or sched.is_finished()):
            samples = pending.pop(0)
            requests.append(samples)
            sched.add(samples[0])
            for s in samples[1:]:
                sched.add(s, after=samples[0])  # shares the first's prompt blocks (LLMEngine.add_requests)
        if requests and rng.random() < 0.03:  # an abort between steps, wherever the sequence is
            seq = rng.choice(rng.choice(requests))
            if not seq.is_finished:
                sched.abort(seq)
                aborted.add(seq)
        loop.step()
        steps += 1
        assert steps < 20_000, "no progress"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    for samples in requests:
        for s in samples:
            if s not in aborted:
                assert s.completion_token_ids == oracle(s.token_ids[:s.num_prompt_tokens], s.sampling_params), \
                    f"seed {seed}: sequence {s.seq_id} differs from the oracle"
    return sched.num_preemptions, speculator


def test_random_workloads_read_only_written_kv():
    preempted = speculated = 0
    for seed in range(300):
        num_preemptions, speculator = run_random_workload(seed)
        preempted += num_preemptions > 0
        speculated += speculator is not None and speculator.stats.num_accepted_tokens > 0
    assert preempted > 30 and speculated > 30  # the workloads covered both


def test_a_chunk_in_flight_registers_no_block_of_a_readmitted_sequence():
    """A prefill chunk is in flight when its sequence is preempted and re-admitted (the priority
    rule can do both in one schedule): processing the chunk must not register blocks of the new
    block table that no step wrote, or a later prefix hit reads K/V never computed."""
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, budget=16)
    loop = Loop(sched, KVDevice(12), overlap=True)
    r = Sequence(list(range(4, 20)), SamplingParams(max_tokens=30, ignore_eos=True), BS)
    v = Sequence([(7 * i) % 40 + 4 for i in range(60)], SamplingParams(max_tokens=4, ignore_eos=True), BS)
    sched.add(r)
    loop.step()
    loop.step()  # r decodes from now on: v's chunks get 15 tokens
    sched.add(v)
    while v.num_computed_tokens < 45:
        loop.step()
    assert loop.inflight[0].seqs[-1] is v and not v.num_inflight  # v's chunk 30..45 is in flight
    sched.preempt(v)
    batch = loop.step()  # v comes back at once: block 0 is a hit, it computes 16..31 in new blocks
    assert v in batch.seqs and v.num_computed_tokens < 32 and v.num_preemptions == 1
    # (loop.step checked that every registered block holds its K/V; the chunk's commit was the risk)
    sched.preempt(v)  # again: whatever it had registered is hit when it comes back
    while not sched.is_finished() or loop.inflight:
        loop.step()
    assert v.completion_token_ids == oracle(v.token_ids[:60], v.sampling_params)
    assert r.completion_token_ids == oracle(r.token_ids[:16], r.sampling_params)


def test_a_higher_priority_arrival_that_shares_a_running_prefix_preempts_nobody():
    """It needs only the blocks past the prefix it shares with a running sequence; when those are
    free it is admitted at once and nothing is preempted (the whole prompt's blocks used to be
    asked for: the low-priority sequence was preempted for nothing)."""
    sched = make_scheduler(num_blocks=9, max_num_seqs=8, budget=128, policy="priority")
    loop = Loop(sched, KVDevice(9), overlap=True)
    prefix = [5 + i % 40 for i in range(48)]
    seqs = {}

    def add(name, prompt, priority, max_tokens):
        seqs[name] = s = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS)
        s.priority = priority
        sched.add(s)
        while not s.num_completion_tokens:
            loop.step()

    add("r", prefix, 0, 14)  # 4 blocks while decoding (49..64 tokens)
    add("v", [10 + (i * 7) % 37 for i in range(50)], 5, 5)  # 4 blocks
    assert sched.block_manager.num_free_blocks == 1
    sched.add(h := Sequence(prefix + [11] * 10, SamplingParams(max_tokens=3, ignore_eos=True), BS))
    h.priority = 1
    seqs["h"] = h
    loop.step()  # 4 blocks, 3 of them r's: the one free block is enough
    assert h.status == SequenceStatus.RUNNING and sched.num_preemptions == 0
    while not sched.is_finished() or loop.inflight:
        loop.step()
    assert sched.num_preemptions == 0
    for s in seqs.values():
        assert s.completion_token_ids == oracle(s.token_ids[:s.num_prompt_tokens], s.sampling_params)


# ---- the real engine: features on vs a plain engine ---------------------------------------------
@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory):
    from lora_reference import make_adapter
    root = tmp_path_factory.mktemp("combo_adapters")
    return [LoRARequest(f"a{i}", i + 1, make_adapter(tiny_qwen3, str(root / f"a{i}"), seed=i)) for i in range(3)]


@pytest.fixture(scope="module")
def draft_other(make_checkpoint):
    return make_checkpoint(seed=1, num_layers=1)


def random_request(rng, vocab: int, prefix: list[int]):
    """A prompt (repeating, so n-gram lookup proposes, or random; maybe after a shared prefix) and
    params whose result does not depend on the batch: greedy or seeded, with every stop rule,
    logprobs, prompt logprobs, n > 1, penalties, bad words, structured outputs."""
    from nanoinfer import StructuredOutputsParams
    if rng.random() < 0.5:
        pattern = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 7))]
        body = pattern * rng.randrange(2, 6)
    else:
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 50))]
    prompt = (prefix if rng.random() < 0.4 else []) + body
    kind = rng.choice(["greedy", "greedy", "seeded", "penalty", "stop_id", "stop_str", "n", "logprobs",
                       "prompt_logprobs", "min_tokens", "eos", "structured", "bad_words"])
    sp = dict(temperature=0, max_tokens=rng.randrange(1, 80), ignore_eos=True)
    if kind == "seeded":
        sp.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000), top_k=rng.choice([0, 20]),
                  top_p=rng.choice([1.0, 0.9]))
    elif kind == "penalty":
        sp.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    elif kind == "stop_id":
        sp.update(stop_token_ids=[rng.randrange(3, vocab) for _ in range(8)])
    elif kind == "stop_str":
        sp.update(stop=[rng.choice(["e", "a", "th", "in", " t"])], include_stop_str_in_output=rng.random() < 0.5)
    elif kind == "n":
        sp.update(n=rng.choice([2, 3]), temperature=1.0, seed=rng.randrange(1000))
    elif kind == "logprobs":
        sp.update(logprobs=rng.choice([0, 3]), temperature=rng.choice([0, 1.0]), seed=rng.randrange(1000))
    elif kind == "prompt_logprobs":
        sp.update(prompt_logprobs=rng.choice([0, 2]))
    elif kind == "min_tokens":
        sp.update(min_tokens=sp["max_tokens"] // 2, stop_token_ids=[rng.randrange(vocab)], seed=5, temperature=0.9)
    elif kind == "eos":
        sp.update(ignore_eos=False)
    elif kind == "structured":
        sp.update(structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]), ignore_eos=False,
                  n=rng.choice([1, 2]), temperature=rng.choice([0, 1.0]), seed=rng.randrange(1000))
    elif kind == "bad_words":
        sp.update(bad_words=[rng.choice(["the", "a b", "in"])])
    return prompt, SamplingParams(**sp)


def summary(out):
    def lps(entries):
        return None if entries is None else \
            [None if d is None else {t: round(lp.logprob, 3) for t, lp in d.items()} for d in entries]
    return ([(c.token_ids, c.text, c.finish_reason, c.stop_reason, lps(c.logprobs)) for c in out.outputs],
            lps(out.prompt_logprobs))


def drive(path, requests, adapters, options, arrivals=None, aborts=()):
    """Every request by hand (add_request between steps, aborts at given steps); returns the
    outputs by request index, the aborted ones, and the engine's counters. Every block is free
    and no request is left at the end."""
    llm = LLM(path, **{"kvcache_block_size": 16, "max_model_len": 256, **options})
    try:
        pending = {}
        for i, step in enumerate(arrivals or [0] * len(requests)):
            pending.setdefault(step, []).append(i)
        rids, aborted, step = {}, set(), 0
        while pending or not llm.is_finished():
            for i in pending.pop(step, []):
                prompt, sp, lora, priority = requests[i]
                rids[i] = llm.add_request(prompt, sp, keep_output=True, priority=priority,
                                          lora_request=None if lora is None else adapters[lora])
            for i, at in aborts:
                if at == step and i in rids:
                    llm.abort_request(rids[i])
                    aborted.add(i)
            llm.step()
            step += 1
            assert step < 5000
        outs = {i: llm.pop_output(rid) for i, rid in rids.items()}
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert not llm.requests and llm.scheduler.is_finished()
        return outs, aborted, llm.scheduler.num_preemptions, llm.spec_stats
    finally:
        llm.exit()


def random_engine_options(rng, tiny_qwen3, draft_other) -> dict:
    spec = rng.choice([None, "ngram", "ngram", "draft_same", "draft_other"])
    options = dict(enable_lora=True, max_lora_rank=8, max_loras=rng.choice([1, 2, 3]), max_cpu_loras=3,
                   scheduling_policy=rng.choice(["fcfs", "priority"]),
                   num_kvcache_blocks=rng.choice([16, 16, 17, 20, 24, 64]),
                   max_num_batched_tokens=rng.choice([32, 48, 64, 512]), max_num_seqs=rng.choice([2, 4, 8]),
                   enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.5)
    if spec == "ngram":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3, 5]),
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif spec == "draft_same":
        options["speculative_config"] = {"model": tiny_qwen3, "num_speculative_tokens": rng.choice([2, 4])}
    elif spec == "draft_other":
        options["speculative_config"] = {"model": draft_other, "num_speculative_tokens": 3}
    return options


@pytest.mark.parametrize("seed", range(8))
def test_features_on_equal_a_plain_engine(tiny_qwen3, draft_other, adapters, seed):
    """Speculative decoding (n-gram, a draft equal to the target, another draft) x LoRA (1-3 slots
    for 3 adapters) x priority x a pool of one max_model_len x chunked prefill x prefix caching on
    / off x overlap on / off, with arrivals between steps and aborts: every request not aborted
    gives what a plain, roomy, synchronous engine gives."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(rng.choice([16, 20, 35]))]
    requests = [(*random_request(rng, 300, prefix), rng.choice([None, None, 0, 1, 2]), rng.randrange(-2, 3))
                for _ in range(rng.randrange(4, 14))]
    options = random_engine_options(rng, tiny_qwen3, draft_other)
    arrivals = [rng.choice([0, 0, 0, 1, 3, 7]) for _ in requests]
    aborts = [(i, rng.randrange(12)) for i in range(len(requests)) if rng.random() < 0.15]
    plain = [(p, sp, lora, 0) for p, sp, lora, _ in requests]
    expected, _, _, _ = drive(tiny_qwen3, plain, adapters, dict(enable_lora=True, max_lora_rank=8, max_loras=3,
                                                                num_kvcache_blocks=400, max_num_seqs=64,
                                                                async_scheduling=False))
    if options["scheduling_policy"] == "fcfs":
        requests = plain
    got, aborted, _, _ = drive(tiny_qwen3, requests, adapters, options, arrivals, aborts)
    for i in range(len(requests)):
        if i not in aborted:
            assert summary(got[i]) == summary(expected[i]), f"request {i}: {requests[i][1]}, options {options}"


def test_priority_tight_pool_with_a_shared_prefix_equals_fcfs(tiny_qwen3):
    """The scenario the KV-device tests found: a low-priority prompt mid-prefill (overlapped
    chunks), a higher-priority arrival sharing a running prefix, then another arrival, in a pool of
    10 blocks: the same tokens as a roomy first-come engine."""
    prefix = [5 + i % 40 for i in range(48)]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (14, 5, 3, 2)]
    prompts = [prefix, [10 + (i * 7) % 37 for i in range(64)], prefix + [11] * 10, [20] * 28]
    requests = [(p, sp, None, prio) for p, sp, prio in zip(prompts, greedy, [0, 5, 1, 2])]
    arrivals = [0, 5, 8, 9]
    outs = {}
    for name, options in (("fcfs", dict(num_kvcache_blocks=40, async_scheduling=False)),
                          ("priority", dict(num_kvcache_blocks=10, max_num_batched_tokens=17,
                                            scheduling_policy="priority"))):
        kept = requests if name == "priority" else [(p, sp, lora, 0) for p, sp, lora, _ in requests]
        got, _, _, _ = drive(tiny_qwen3, kept, [], dict(max_num_seqs=8, max_model_len=160, **options), arrivals)
        outs[name] = [got[i].outputs[0].token_ids for i in range(4)]
    assert outs["priority"] == outs["fcfs"]


@pytest.mark.parametrize("seed", range(3))
def test_images_with_speculative_decoding_equal_plain(make_vl_checkpoint, seed):
    """Prompts with 0-3 images (shared ones among them) and text, n-gram or a draft equal to the
    target (which sees the image tokens as text: only its proposals get worse), a tight pool,
    chunked prefill, overlap: the tokens of a plain engine; no image embedding is left behind."""
    from vl_reference import random_image
    path = make_vl_checkpoint()
    rng = random.Random(seed)
    images = [random_image(rng.choice([56, 112, 200]), rng.choice([56, 112, 168]), seed=s) for s in range(3)]
    placeholder = "<|vision_start|><|image_pad|><|vision_end|> "
    prompts, params = [], []
    for _ in range(rng.randrange(4, 9)):
        words = " ".join(rng.choice(["cat", "dog", "the", "a", "sat", "on", "mat"])
                         for _ in range(rng.randrange(1, 12)))
        k = rng.randrange(4)
        prompt = {"prompt": placeholder * k + words + " " + words}
        if k:
            prompt["multi_modal_data"] = {"image": [rng.choice(images) for _ in range(k)]}
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 60), ignore_eos=True,
                                     logprobs=rng.choice([None, 2]), prompt_logprobs=rng.choice([None, None, 1])))
    spec = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            {"model": path, "num_speculative_tokens": 3}][seed % 2]
    outs = {}
    for name, options in (("plain", dict(num_kvcache_blocks=200, async_scheduling=False)),
                          ("spec", dict(num_kvcache_blocks=17, max_num_batched_tokens=48, max_num_seqs=4,
                                        scheduling_policy="priority", speculative_config=spec))):
        llm = LLM(path, device="cpu", kvcache_block_size=16, max_model_len=256, **options)
        try:
            outs[name] = [summary(o) for o in llm.generate(prompts, params, use_tqdm=False,
                                                           priority=[rng.randrange(3) for _ in prompts]
                                                           if name == "spec" else None)]
            bm = llm.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks
            assert not llm.model_runner.feature(ImageRankFeature).cache.embeddings and not llm.feature(ImageFeature).planner.resident
            if name == "spec":
                assert llm.spec_stats.num_drafts > 0
        finally:
            llm.exit()
    assert outs["spec"] == outs["plain"]


def test_a_draft_equal_to_its_target_is_always_accepted_whatever_shapes_greedy_logits(tiny_qwen3):
    """Greedy requests whose logits are changed before the argmax (penalties, logit bias, allowed
    tokens, bad words, min_tokens) propose through their sampling plan: a draft equal to the target
    proposes exactly what the target picks (the raw argmax was mostly rejected), with the tokens
    of plain decoding."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    params = [SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.4),
              SamplingParams(**greedy, logit_bias={p: 4.0 for p in prompts[1][:4]}),
              SamplingParams(**greedy, allowed_token_ids=sorted(set(prompts[2]))),
              SamplingParams(**dict(greedy, ignore_eos=False), min_tokens=20),
              SamplingParams(**greedy, bad_words=["the", "a"]),
              SamplingParams(**greedy, frequency_penalty=0.5, logprobs=2)]
    outs = {}
    for spec in (None, {"model": tiny_qwen3, "num_speculative_tokens": 3}):
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, speculative_config=spec)
        try:
            outs[spec is None] = [summary(o) for o in llm.generate(prompts, params, use_tqdm=False)]
            if spec:
                stats = llm.spec_stats
                assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
        finally:
            llm.exit()
    assert outs[True] == outs[False]


def test_stream_with_speculative_rows_and_stop_strings(tiny_qwen3):
    """stream(): a speculative row appends several tokens a step; the deltas still add up to the
    final output, and a stop string inside an accepted run ends the text and tokens there."""
    rng = random.Random(3)
    pattern = [rng.randrange(3, 300) for _ in range(5)]
    prompts = [pattern * 4, pattern * 3 + [7], [rng.randrange(3, 300) for _ in range(20)]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s], logprobs=1)
              for s in ("e", "th", "zz")]
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 1}):
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, speculative_config=spec)
        try:
            final = llm.generate(prompts, params, use_tqdm=False)
            text, tokens, lps = {}, {}, {}
            for d in llm.stream(prompts, params):
                text[d.index] = text.get(d.index, "") + d.text
                tokens[d.index] = tokens.get(d.index, []) + list(d.token_ids)
                lps[d.index] = lps.get(d.index, []) + list(d.logprobs or [])
            for i, o in enumerate(final):
                assert (text[i], tokens[i]) == (o.outputs[0].text, o.outputs[0].token_ids)
                assert len(lps[i]) == len(tokens[i])
            outs[spec is None] = [summary(o) for o in final]
            if spec:
                assert llm.spec_stats.num_accepted_tokens > 0
        finally:
            llm.exit()
    assert outs[True] == outs[False]


def test_embeddings_take_their_lora_adapter(tiny_qwen3, adapters):
    """runner="pooling" with enable_lora: a request's adapter shapes its embedding (HF + PEFT's
    final hidden state), through embed(lora_request=...) and add_request; the base and each adapter
    stay apart in the prefix cache."""
    from lora_reference import reference_model
    prompt = list(range(5, 45))

    def peft_embedding(adapter):
        model = reference_model(tiny_qwen3, None if adapter is None else adapter.lora_path)
        inner = model.model if adapter is None else model.base_model.model.model
        with torch.no_grad():
            return torch.nn.functional.normalize(inner(torch.tensor([prompt])).last_hidden_state[0, -1], dim=0)

    llm = LLM(tiny_qwen3, runner="pooling", enable_lora=True, max_lora_rank=8, max_loras=2,
              kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=16)
    try:
        loras = [None, adapters[0], adapters[1], None, adapters[0]]
        outs = llm.encode([prompt] * 5, use_tqdm=False, lora_request=loras)
        for out, lora in zip(outs, loras):
            assert torch.allclose(out.outputs.data, peft_embedding(lora), atol=1e-4)
        rid = llm.add_request(prompt, PoolingParams(), lora_request=adapters[2], keep_output=True)
        while not llm.is_finished():
            llm.step()
        assert torch.allclose(llm.pop_output(rid).outputs.data, peft_embedding(adapters[2]), atol=1e-4)
        one = llm.embed(prompt, use_tqdm=False, lora_request=adapters[1])[0].outputs.embedding
        assert torch.allclose(torch.tensor(one), peft_embedding(adapters[1]), atol=1e-4)
    finally:
        llm.exit()


# ---- combinations refused at construction ---------------------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def test_refused_combinations_are_value_errors_at_construction(tiny_qwen3, make_vl_checkpoint):
    vl = make_vl_checkpoint()
    refused = [
        (dict(model=tiny_qwen3, runner="pooling", speculative_config=NGRAM), "pooling"),
        (dict(model=tiny_qwen3, task="embed", speculative_config={"model": tiny_qwen3, "num_speculative_tokens": 2}),
         "pooling"),
        (dict(model=vl, enable_lora=True), "enable_lora"),
        (dict(model=tiny_qwen3, speculative_config={"model": vl, "num_speculative_tokens": 2}), "vocab"),
        (dict(model=vl, speculative_config={"model": tiny_qwen3, "num_speculative_tokens": 2}), "vocab"),
        (dict(model=tiny_qwen3, speculative_config={"method": "ngram", "model": tiny_qwen3,
                                                    "num_speculative_tokens": 2}), "ngram"),
        (dict(model=tiny_qwen3, speculative_config={"method": "ngram", "num_speculative_tokens": 0}),
         "num_speculative_tokens"),
    ]
    for options, match in refused:
        with pytest.raises(ValueError, match=match):
            LLM(kvcache_block_size=16, max_model_len=128, **options)


@pytest.mark.parametrize("options", [
    dict(enable_lora=True, max_lora_rank=8, speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
    dict(speculative_config=NGRAM, enable_prefix_caching=False, scheduling_policy="priority"),
    dict(runner="pooling", scheduling_policy="priority", async_scheduling=False, enable_lora=True, max_lora_rank=8),
], ids=["lora+draft", "ngram+priority+no-prefix-cache", "pooling+priority+lora"])
def test_accepted_combinations_run(tiny_qwen3, options):
    """Combinations that are not refused serve requests (a draft model needs no adapter: it only
    proposes, and the target verifies under the request's adapter)."""
    spec = options.get("speculative_config")
    if spec is not None and spec.get("method") == "draft_model":
        options = dict(options, speculative_config=dict(spec, model=tiny_qwen3))
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128, **options)
    try:
        if llm.config.runner == "pooling":
            assert len(llm.embed(["a b", "c"], use_tqdm=False, priority=[1, 0])) == 2
        else:
            outs = llm.generate(["a b a b a b", "c"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_blocks
    finally:
        llm.exit()
