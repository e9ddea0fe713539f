"""The engine's side of sampling: a step's SamplingParams as a SamplingPlan (step/step_message.py).

It runs on the host every step, so it reads the options that do not depend on a row's progress
once per SamplingParams object (the registered options' uses() too), and visits one by one only the
rows whose options do (seeds, logprobs). Options no row uses stay None, so the plan stays small to
pickle and the rank that samples skips them.
"""
import random
from functools import lru_cache
from operator import attrgetter

from nanoinfer.step.step_message import SamplingPlan
from nanoinfer.sampling.noise import seed_keys
from nanoinfer.sampling.option import PlanRows
from nanoinfer.sampling_params import SAMPLING_EPS

TOP_K_OFF = 1 << 62  # larger than any vocabulary (logits may be wider than the tokenizer's vocab)


def build_sampling_plan(seqs, vocab_size: int, eos_token_ids, samples=None, prev_row_of=None,
                        seeds: random.Random | None = None, masks_later: bool = False,
                        options=()) -> SamplingPlan:
    """One per step. `seeds`: where a fused plan draws its seed (None: Python's default generator;
    a Python one, since torch.randint cost the host more than the rest of a batch-1 plan).
    `samples[i]`: row i's sample is counted in its sequence's num_inflight (a scheduled step).
    `prev_row_of`: seq_id -> row of the step still in flight, for rows that sampled: such a
    token is not on the host yet, so it counts for seeds, and the options read it (PlanRows).
    `masks_later`: a token mask is left to the engine, which fills it once the forward is launched.
    `options`: the registered SamplingOptions (sampling/option.py), in order."""
    counted = samples or [False] * len(seqs)
    seeded, keys, lp_rows, lp_counts = [], [], [], []
    # (the rows of one request, or of one generate() call, share their SamplingParams object)
    memo, rows, off = {}, [], _off_fields(tuple(options))
    for seq in seqs:
        sp = seq.sampling_params
        if (row := memo.get(id(sp))) is None:
            row = memo[id(sp)] = _static_options(sp, vocab_size, options, off)
        rows.append(row)
    temps, top_ks, top_ps, min_ps, uses_top_k, uses_top_p, uses_min_p, dynamic, used = map(list, zip(*rows)) \
        if rows else ([] for _ in range(9))
    use_top_k = any(uses_top_k)
    for i in [i for i, d in enumerate(dynamic) if d]:
        sp = seqs[i].sampling_params
        if temps[i] != 0.0 and sp.seed is not None:
            seeded.append(i)
            keys.append(seed_keys(sp.seed, seqs[i].num_completion_tokens + seqs[i].num_inflight - counted[i]))
        if sp.logprobs is not None:
            lp_rows.append(i)
            lp_counts.append(sp.logprobs)
    # (temperatures are >= 0, a greedy row's 0.0; a greedy row uses no filter and no seed)
    p = SamplingPlan(temps, all_greedy=not any(temps), any_greedy=0.0 in temps, top_k=top_ks if use_top_k else None,
                     max_top_k=max(k for k in top_ks if k != TOP_K_OFF) if use_top_k else 0,
                     top_p=top_ps if any(uses_top_p) else None, min_p=min_ps if any(uses_min_p) else None,
                     seeded_rows=seeded or None, seed_keys=keys or None)
    if lp_rows:
        p.lp_rows = None if len(lp_rows) == len(seqs) else lp_rows
        p.lp_counts, p.lp_max = lp_counts, min(max(lp_counts), vocab_size)
    if options and (any(used) or any(o.pending for o in options)):
        p.options = _plan_options(options, used, PlanRows(seqs, samples, counted, prev_row_of, list(eos_token_ids),
                                                          vocab_size, masks_later))
    if p.fused:
        p.seed = (seeds or random).randrange(2**31 - 1)
    return p


@lru_cache(maxsize=16)
def _off_fields(options: tuple):
    """A getter of every SamplingParams field the options read and what it returns when every
    option is off (SamplingOption.off); None: each option is asked (one declares none), if any."""
    if not options or not all(o.off for o in options):
        return None
    off = {name: value for o in options for name, value in o.off.items()}
    values = tuple(off.values())
    return attrgetter(*off), values if len(values) > 1 else values[0]


def _static_options(sp, vocab_size: int, options, off) -> tuple:
    """A row's temperature (0.0: greedy), top-k (TOP_K_OFF: off), top-p and min-p; whether it uses
    top-k, top-p, min-p (a greedy row uses none); whether it needs the per-row pass (seeds,
    logprobs); and the registered options its rows use (None: none)."""
    greedy = sp.temperature < SAMPLING_EPS
    k = sp.top_k if 0 < sp.top_k < vocab_size else TOP_K_OFF
    dynamic = (not greedy and sp.seed is not None) or sp.logprobs is not None
    used = None
    if options and (off is None or off[0](sp) != off[1]):
        used = [o for o in options if o.uses(sp)] or None
    # (SamplingParams stores temperature, top_p and min_p as floats)
    return (0.0 if greedy else sp.temperature, k, sp.top_p, sp.min_p,
            not greedy and k != TOP_K_OFF, not greedy and sp.top_p < 1.0, not greedy and sp.min_p > 0.0, dynamic, used)


def _plan_options(options, used: list, ctx: PlanRows) -> list | None:
    """Each option's payload for the rows that use it, in the options' order (None: no payload)."""
    rows_of = {o: [] for o in options}
    for i, row_options in enumerate(used):
        for o in row_options or ():
            rows_of[o].append(i)
    payloads = [payload for o, rows in rows_of.items()
                if (rows or o.pending) and (payload := o.plan(rows, ctx)) is not None]
    return payloads or None
