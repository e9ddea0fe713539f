"""A step's speculative rows, from proposals to the sampling rows they expand into.

The scheduler places each speculative row after the decode rows with room for k proposals
(speculative/row_planner.py). Once proposed (`attach_drafts`), a row with fewer proposals is
shortened, and one with none becomes a plain decode row (moved into the decode section, so a step
without proposals stays decode-only). For sampling, a row with m proposals is m + 1 sampling rows,
one per position, each seeing the proposals before it as if they were accepted (`DraftView`,
speculative/draft_rows.py): that is what makes penalties, seeds, min_tokens, bad words and logprobs
exact at every position.
"""
from nanoinfer.engine.scheduler import ScheduledBatch


def attach_drafts(batch: ScheduledBatch, drafts: dict[int, list[int]]):
    """Fill in the proposals of the batch's speculative rows (row -> tokens, at most the row's k)."""
    first = batch.num_decode
    rows = sorted(batch.drafts)
    assert rows == list(range(first, first + len(rows)))  # (the scheduler's layout)
    order = [r for r in rows if not drafts.get(r)] + [r for r in rows if drafts.get(r)]
    new_drafts = {}
    for r in rows:
        draft = drafts.get(r) or []
        unused = batch.query_lens[r] - 1 - len(draft)
        seq = batch.seqs[r]
        seq.num_computed_tokens -= unused
        seq.num_inflight -= unused
        batch.query_lens[r] -= unused
    for name in ("seqs", "starts", "query_lens", "samples"):
        column = getattr(batch, name)
        column[first:first + len(rows)] = [column[r] for r in order]
    for i, r in enumerate(order):
        if drafts.get(r):
            new_drafts[first + i] = list(drafts[r])
    batch.num_decode += len(rows) - len(new_drafts)
    batch.drafts = new_drafts


def accepted_runs(batch: ScheduledBatch, tokens: list[int], logprobs: list | None):
    """A step's sampled tokens (one per sampling row) -> (one token per row, row -> accepted run,
    per-row logprobs: a list for a speculative row). A run is the proposals the target sampled
    too, up to the first it did not, then the target's own token there (or after the last).

    Every emitted token is the target's own sample at its position, drawn with noise that the
    tokens before it do not depend on, so the output is distributed as the target's. For a
    proposal made for sure (q one-hot: n-gram, a greedy draft) this is the rejection sampler: its
    accept probability min(1, p/q) is p(draft), the chance that a sample of p equals it, and on
    rejection norm(max(0, p - q)) is p without the draft token: the sample of p at that position,
    given that it differs. A sampled draft (speculative/draft_model.py) draws with independent noise, or
    with the request's seeded noise, the target's own: then a draft close to the target proposes
    the target's sample itself."""
    row_tokens, runs, row_lps = [], {}, [] if logprobs is not None else None
    i = 0
    for row in range(len(batch.seqs)):
        draft = batch.drafts.get(row)
        if draft is None:
            row_tokens.append(tokens[i])
            if logprobs is not None:
                row_lps.append(logprobs[i])
            i += 1
            continue
        sampled = tokens[i:i + len(draft) + 1]
        a = 0
        while a < len(draft) and sampled[a] == draft[a]:
            a += 1
        runs[row] = sampled[:a + 1]
        row_tokens.append(sampled[a])
        if logprobs is not None:
            row_lps.append(logprobs[i:i + a + 1])
        i += len(draft) + 1
    return row_tokens, runs, row_lps
