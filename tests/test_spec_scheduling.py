"""The scheduler with speculative rows, driven by a fake model whose next token is a function of
the whole history and a fake proposer that is right or wrong at random: under random workloads
(EOS, max_tokens, tight pools with preemption, chunked prefill) every sequence's tokens equal plain
decoding's, lookahead blocks stay within the pool, and every block is free at the end."""
import random

import xxhash

from nanoinfer.speculative.row_planner import SpeculativeRows
from nanoinfer.step.step_message import StepResult
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.step.sequence import Sequence
from nanoinfer.speculative.config import SpeculativeConfig
from nanoinfer.speculative.draft_rows import sampling_rows
from nanoinfer.speculative.speculator import Speculator
from test_scheduler import BS, EOS, make_scheduler


def next_token(token_ids):
    return xxhash.xxh32(str(token_ids).encode()).intdigest() % 50


class FakeProposer:
    """Proposes the fake model's tokens, with a wrong one at a random position (or none at all)."""

    def __init__(self, rng):
        self.rng = rng

    def propose(self, seqs, max_lens):
        out = []
        for seq, k in zip(seqs, max_lens):
            tokens, proposal = list(seq.token_ids), []
            wrong = self.rng.randrange(k + 2)
            for j in range(self.rng.choice([0, k, k, self.rng.randrange(k + 1)])):
                t = next_token(tokens) if j != wrong else (next_token(tokens) + 1) % 50
                proposal.append(t)
                tokens.append(t)
            out.append(proposal)
        return out

    def exit(self):
        pass


def run(workload, num_blocks, budget, speculate: bool, seed: int):
    sched = make_scheduler(num_blocks, 8, budget, max_model_len=200)
    speculator = None
    if speculate:
        speculator = Speculator(SpeculativeConfig("ngram", 3), 200, FakeProposer(random.Random(seed)))
        sched.rows = SpeculativeRows(speculator)
    seqs = [Sequence(p, SamplingParams(max_tokens=m), BS) for p, m in workload]
    for s in seqs:
        sched.add(s)
    while not sched.is_finished():
        batch = sched.schedule()
        if batch.drafts:
            speculator.propose(batch)
        rows, _, _ = sampling_rows(batch) if batch.drafts else (batch.seqs, None, None)
        tokens = [next_token(r.token_ids) for r in rows]
        runs = None
        if batch.drafts:
            tokens, runs, _ = speculator.verify(batch, StepResult(tokens))
        sched.finish_rows(batch, sched.update(batch, tokens, runs), {})
        bm = sched.block_manager
        assert 0 <= bm.num_free_blocks <= bm.num_blocks
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    return [s.completion_token_ids for s in seqs], sched, speculator


def test_random_workloads_equal_plain_decoding():
    ended_on_eos = preempted = partly_accepted = 0
    for seed in range(12):
        rng = random.Random(seed)
        workload = []
        for _ in range(rng.randrange(1, 7)):
            prompt = [rng.randrange(4, 50) for _ in range(rng.randrange(1, 40))]
            workload.append((prompt, rng.randrange(1, 40)))
        num_blocks, budget = rng.choice([(8, 32), (12, 24), (64, 64)])
        plain, _, _ = run(workload, num_blocks, budget, False, seed)
        spec, sched, speculator = run(workload, num_blocks, budget, True, seed)
        assert spec == plain, f"seed {seed}"
        assert speculator.stats.num_drafts > 0
        ended_on_eos += sum(bool(c) and c[-1] == EOS for c in plain)
        preempted += sched.num_preemptions
        s = speculator.stats
        partly_accepted += 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert ended_on_eos and preempted and partly_accepted  # the workloads covered those cases
