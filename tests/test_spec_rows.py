"""Speculative rows: proposals attached (rows shortened, rows without any moved among the decode
rows), sampling rows per position, and accepted runs from the sampled tokens."""
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.speculative.draft_rows import sampling_rows
from nanoinfer.speculative.rows import accepted_runs, attach_drafts

SP = SamplingParams(temperature=0, max_tokens=50)


def seq_with(n_prompt, n_out):
    s = Sequence(list(range(1, n_prompt + 1)), SP, 16)
    for t in range(n_out):
        s.append_token(100 + t)
    return s


def speculative_batch():
    """One decode row, three speculative rows with room for 3 proposals each, one prefill chunk."""
    seqs = [seq_with(5, 1), seq_with(6, 2), seq_with(7, 1), seq_with(4, 3), seq_with(9, 0)]
    b = ScheduledBatch([], [], [], [], num_decode=1)
    for i, s in enumerate(seqs):
        q = 1 if i == 0 else 4 if i < 4 else 9
        start = s.num_tokens - 1 if i < 4 else 0
        s.num_computed_tokens = start + q
        s.num_inflight = 1
        b.seqs.append(s), b.starts.append(start), b.query_lens.append(q), b.samples.append(True)
    b.drafts = {1: None, 2: None, 3: None}
    return seqs, b


def test_attach_drafts_shortens_and_moves_rows_without_proposals():
    seqs, b = speculative_batch()
    attach_drafts(b, {1: [7, 8], 2: [], 3: [5, 6, 7]})
    assert b.seqs == [seqs[0], seqs[2], seqs[1], seqs[3], seqs[4]]
    assert b.num_decode == 2 and b.drafts == {2: [7, 8], 3: [5, 6, 7]}
    assert b.query_lens == [1, 1, 3, 4, 9]
    assert seqs[2].num_computed_tokens == seqs[2].num_tokens  # a plain decode row now
    assert seqs[1].num_computed_tokens == seqs[1].num_tokens - 1 + 3


def test_sampling_rows_and_accepted_runs():
    seqs, b = speculative_batch()
    attach_drafts(b, {1: [7, 8], 2: [], 3: [5, 6, 7]})
    views, samples, token_rows = sampling_rows(b)
    assert len(views) == 1 + 1 + 3 + 4 + 1 and all(samples)
    # flat token rows: decode 0, decode 1, row 2 at 2..4, row 3 at 5..8, the prefill's last at 17
    assert token_rows == [0, 1, 2, 3, 4, 5, 6, 7, 8, 17]
    assert views[3].token_ids == seqs[1].token_ids + [7] and views[3].num_completion_tokens == 3
    sampled = [11, 12, 7, 9, 4, 5, 6, 7, 3, 13]  # row 2: 7 accepted, then 9; row 3: all three, then 3
    tokens, runs, lps = accepted_runs(b, sampled, list(range(10)))
    assert tokens == [11, 12, 9, 3, 13]
    assert runs == {2: [7, 9], 3: [5, 6, 7, 3]}
    assert lps == [0, 1, [2, 3], [5, 6, 7, 8], 9]
