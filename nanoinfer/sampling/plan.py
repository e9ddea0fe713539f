"""The engine's side of sampling: a step's SamplingParams as a SamplingPlan (step/step_message.py).

It runs on the host every step, so it reads the options that do not depend on a row's progress
once per SamplingParams object, and visits one by one only the rows whose options do (seeds,
penalties, min_tokens, logprobs, token constraints), appending to column lists, no object per
row; options no row uses stay None, so the plan stays small to pickle and the rank that samples
(sampling/tensors.py) skips them. A request's allowed_token_ids, logit_bias and one-token bad words
are sent to that rank once and then named by key (sampling/constraint_registry.py): a row costs the
same whatever their sizes. Here too, since they read the host's token history: which tokens
multi-token bad words ban, and the grammar bitmasks of structured outputs (each row's
matcher advances over its new tokens, then fills its next-token mask: the grammar state
the feature attached to the sequence, structured/grammar_state.py),
unless the engine fills those after launching the forward (`masks_later`: structured/step_masks.py).
"""
import random
from array import array

from nanoinfer.step.step_message import SamplingPlan
from nanoinfer.sampling.constraint_registry import TokenConstraintRegistry
from nanoinfer.sampling.noise import seed_keys
from nanoinfer.sampling_params import SAMPLING_EPS

TOP_K_OFF = 1 << 62  # larger than any vocabulary (logits may be wider than the tokenizer's vocab)


def build_sampling_plan(seqs, vocab_size: int, eos_token_ids, samples=None, prev_row_of=None,
                        seeds: random.Random | None = None, masks_later: bool = False,
                        constraints: TokenConstraintRegistry | None = None) -> SamplingPlan:
    """One per step: a pass over the batch reading each request's options.
    `seeds`: where a plain plan draws its seed (the engine's generator, seeded from the
    config; None: Python's default one). (A Python generator: torch.randint cost the host more
    than the rest of a batch-1 plan.)
    `samples[i]`: row i's sample is counted in its sequence's num_inflight (a scheduled step).
    `prev_row_of`: seq_id -> row of the step still in flight, for rows that sampled: such a
    token is not on the host yet, so it counts for seeds and min_tokens, and joins the penalty
    history on the device.
    `masks_later`: the plan names its grammar rows and leaves their bitmask None; the engine fills it
    once the forward is launched (structured/step_masks.py), when their tokens in flight are in.
    `constraints`: which requests' token constraints (allowed ids, logit bias, one-token bad words)
    the sampling rank holds (sampling/constraint_registry.py); None: this plan sends those it names
    and has them dropped after its step."""
    if constraints is None:
        constraints = TokenConstraintRegistry(ephemeral=True)
    constraints.start_plan()
    counted = samples or [False] * len(seqs)
    pen, supp_rows, supp_toks, seeded, keys, lp_rows, lp_counts = [], [], [], [], [], [], []
    c_rows, c_keys, procs, grammar_rows, grammar_seqs = [], [], [], [], []
    eos = list(eos_token_ids)
    # the options that do not depend on a row's progress, once per SamplingParams object (the
    # rows of one request, or of one generate() call, share theirs); the loop after visits only
    # the rows whose options do depend on it
    memo, rows = {}, []
    for seq in seqs:
        sp = seq.sampling_params
        row = memo.get(id(sp))
        if row is None:
            row = memo[id(sp)] = _static_options(sp, vocab_size)
        rows.append(row)
    temps, top_ks, top_ps, min_ps, uses_top_k, uses_top_p, uses_min_p, dynamic = map(list, zip(*rows)) \
        if rows else ([] for _ in range(8))
    use_top_k, use_top_p, use_min_p = any(uses_top_k), any(uses_top_p), any(uses_min_p)
    for i in [i for i, d in enumerate(dynamic) if d]:
        seq = seqs[i]
        sp = seq.sampling_params
        # tokens generated before this row's sample (host + in flight, this row's own excluded)
        generated = seq.num_completion_tokens + seq.num_inflight - counted[i]
        if temps[i] != 0.0 and sp.seed is not None:
            seeded.append(i)
            keys.append(seed_keys(sp.seed, generated))
        if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0:
            pen.append(i)
        if sp.min_tokens and generated < sp.min_tokens:
            ids = sp.stop_token_ids if sp.ignore_eos else eos + sp.stop_token_ids
            supp_rows.extend([i] * len(ids))
            supp_toks.extend(ids)
        if sp.logprobs is not None:
            lp_rows.append(i)
            lp_counts.append(sp.logprobs)
        if sp.has_token_constraints:
            sampled = samples is None or samples[i]
            _add_token_constraints(i, seq, generated, sampled, masks_later, constraints, c_rows, c_keys, procs,
                                   supp_rows, supp_toks)
            if sp.structured_outputs is not None and sampled:
                grammar_rows.append(i)
                grammar_seqs.append(seq)
    B = len(seqs)
    all_greedy = not any(temps)  # (temperatures are >= 0; a greedy row's is 0.0)
    p = SamplingPlan(temps, all_greedy=all_greedy, any_greedy=0.0 in temps)
    if not all_greedy:
        if use_top_k:
            p.top_k, p.max_top_k = top_ks, max(k for k in top_ks if k != TOP_K_OFF)
        if use_top_p:
            p.top_p = top_ps
        if use_min_p:
            p.min_p = min_ps
        if seeded:
            p.seeded_rows, p.seed_keys = seeded, keys
    if pen:
        _add_penalties(p, seqs, pen, counted, prev_row_of)
    if supp_rows:
        p.suppress_rows, p.suppress_tokens = supp_rows, supp_toks
    if lp_rows:
        p.lp_rows = None if len(lp_rows) == B else lp_rows
        p.lp_counts, p.lp_max = lp_counts, min(max(lp_counts), vocab_size)
    p.processors = procs or None
    if c_rows:
        p.constraint_rows, p.constraint_keys = c_rows, c_keys
    p.new_constraints, p.dropped_constraints = constraints.take_updates()
    if grammar_rows:
        p.grammar_rows = grammar_rows
        if not masks_later:
            # (the grammar state structured outputs attached at intake fills the rows' masks, batched)
            p.grammar_bitmask = grammar_seqs[0].grammar.fill_bitmasks(grammar_seqs, vocab_size)
    if p.fused:
        p.seed = (seeds or random).randrange(2**31 - 1)
    return p


def _static_options(sp, vocab_size: int) -> tuple:
    """A row's temperature (0.0: greedy), top-k (TOP_K_OFF: off), top-p and min-p; whether it uses
    top-k, top-p, min-p (a greedy row uses none); and whether it needs the per-row pass (seeds,
    penalties, min_tokens, logprobs, token constraints)."""
    greedy = sp.temperature < SAMPLING_EPS
    k = sp.top_k if 0 < sp.top_k < vocab_size else TOP_K_OFF
    dynamic = (not greedy and sp.seed is not None) or bool(sp.min_tokens) or sp.logprobs is not None \
        or sp.has_token_constraints \
        or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0
    return (0.0 if greedy else float(sp.temperature), k, float(sp.top_p), float(sp.min_p),
            not greedy and k != TOP_K_OFF, not greedy and sp.top_p < 1.0, not greedy and sp.min_p > 0.0, dynamic)


def _add_token_constraints(i, seq, generated, sampled, masks_later, constraints, c_rows, c_keys, procs,
                           supp_rows, supp_toks):
    """Row i's allowed_token_ids, logit_bias and one-token bad words (by key: the sampling rank
    holds them), the bans of its multi-token bad words, and its logits processors (a row without
    any never calls this)."""
    sp = seq.sampling_params
    key = constraints.key_for(sp)
    if key is not None:
        c_rows.append(i)
        c_keys.append(key)
    needs = sp.needs_host_tokens_to_launch if masks_later else sp.needs_host_tokens
    if needs and generated != seq.num_completion_tokens:
        raise RuntimeError("a request with logits_processors, multi-token bad_words or structured outputs "
                           "was scheduled before the host saw its previous token")
    if sp.bad_words_token_ids:
        banned = constraints.banned_after(sp, seq.token_ids, seq.num_prompt_tokens)
        supp_rows.extend([i] * len(banned))
        supp_toks.extend(banned)
    if sp.logits_processors and sampled:
        n = seq.num_prompt_tokens
        procs.append((i, sp.logits_processors, seq.token_ids[:n], seq.token_ids[n:]))


def _add_penalties(p: SamplingPlan, seqs, pen: list[int], counted, prev_row_of) -> None:
    """The penalised rows' token histories, padded into one flat [P, L] int64 buffer. A row whose
    last token is still in flight gets a late entry: the device writes that token after its history."""
    rows = [seqs[i] for i in pen]
    late = [(j, len(s.token_ids), prev_row_of[s.seq_id]) for j, s in enumerate(rows)
            if prev_row_of and s.seq_id in prev_row_of and s.num_inflight - counted[pen[j]] > 0]
    width = max(len(s.token_ids) for s in rows) + (1 if late else 0)
    flat = array("q")  # C-level copies of the histories, not a Python list per row
    for s in rows:
        flat.extend(s.token_ids)
        flat.extend([-1] * (width - len(s.token_ids)))
    p.pen_rows = None if len(pen) == len(seqs) else pen
    p.pen_tokens, p.pen_late = flat, late
    p.pen_prompt_lens = [s.num_prompt_tokens for s in rows]
    p.presence = [s.sampling_params.presence_penalty for s in rows]
    p.frequency = [s.sampling_params.frequency_penalty for s in rows]
    p.repetition = [s.sampling_params.repetition_penalty for s in rows]

