"""Per step, the batch's SamplingParams as a few device tensors for the Sampler (layers/sampler.py):
[B]-sized temperatures and filters, and only for rows that use them penalty histories, banned
tokens (min_tokens, bad words, allowed_token_ids), logit biases, seeds, logprob requests and logits
processors. Two halves: the engine builds a SamplingPlan (plain lists, by one Python loop over the
batch), and the rank that samples turns it into SamplingTensors; vocabulary-sized work happens only
on the device."""
from array import array
from dataclasses import dataclass

import torch

from nanoinfer.sampling_params import SAMPLING_EPS

_M32 = 0xFFFFFFFF
TOP_K_OFF = 1 << 62  # larger than any vocabulary (logits may be wider than the tokenizer's vocab)


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor                 # [B] float32; rows < SAMPLING_EPS are greedy
    all_greedy: bool = False
    any_greedy: bool = True
    top_k: torch.Tensor | None = None          # [B] int64, TOP_K_OFF where off
    max_top_k: int = 0                          # largest top_k among rows using it
    top_p: torch.Tensor | None = None          # [B] float32, 1.0 where off
    min_p: torch.Tensor | None = None          # [B] float32, 0.0 where off
    # penalties, for rows `pen_rows` (None = all rows)
    pen_rows: torch.Tensor | None = None
    pen_tokens: torch.Tensor | None = None     # [P, L] int64 prompt+output token ids, padded with -1
    pen_prompt_lens: torch.Tensor | None = None  # [P] int64
    presence: torch.Tensor | None = None       # [P] float32
    frequency: torch.Tensor | None = None      # [P]
    repetition: torch.Tensor | None = None     # [P]
    # min_tokens: logits[suppress_rows, suppress_tokens] = -inf
    suppress_rows: torch.Tensor | None = None
    suppress_tokens: torch.Tensor | None = None
    # seeded rows: their noise comes from hash(seed, step, token)
    seeded_rows: torch.Tensor | None = None
    seed_keys: torch.Tensor | None = None      # [S, 2] int64, two 32-bit keys per row
    # logprobs for rows `lp_rows` (None = all rows), top `lp_max` of them
    lp_rows: torch.Tensor | None = None
    lp_rows_list: list[int] | None = None
    lp_counts: list[int] | None = None         # per lp row, its own N
    lp_max: int | None = None
    # allowed_token_ids: rows `allowed_rows` keep only (allowed_pos[j] -> row allowed_rows[pos], token)
    allowed_rows: torch.Tensor | None = None
    allowed_pos: torch.Tensor | None = None
    allowed_tokens: torch.Tensor | None = None
    # logit_bias: logits[bias_rows, bias_tokens] += bias_values
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # logits_processors: (row, callables, prompt token ids, output token ids), run on the host
    processors: list | None = None
    plain: bool = False                        # SamplingPlan.plain
    seed: int | None = None                    # SamplingPlan.seed

    @property
    def edits_logits(self) -> bool:
        return (self.suppress_rows is not None or self.pen_tokens is not None or self.allowed_rows is not None
                or self.bias_rows is not None or self.processors is not None)

    @classmethod
    def build(cls, seqs, vocab_size: int, eos_token_ids, device: torch.device) -> "SamplingTensors":
        """SamplingPlan.build, then from_plan, for a batch with no step in flight (tests, benchmarks)."""
        return cls.from_plan(SamplingPlan.build(seqs, vocab_size, eos_token_ids), device)

    @classmethod
    def from_plan(cls, plan: "SamplingPlan", device: torch.device, prev_tokens=None) -> "SamplingTensors":
        """The plan's lists as device tensors (rank 0). `prev_tokens`: the tokens of the step in
        flight, on the device, which the plan's late penalty entries read."""
        pin = device.type == "cuda"

        def dev(data, dtype):
            return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

        p = plan
        t = cls(dev(p.temperatures, torch.float32), all_greedy=p.all_greedy, any_greedy=p.any_greedy, plain=p.plain,
                seed=p.seed)
        if p.top_k is not None:
            t.top_k, t.max_top_k = dev(p.top_k, torch.int64), p.max_top_k
        if p.top_p is not None:
            t.top_p = dev(p.top_p, torch.float32)
        if p.min_p is not None:
            t.min_p = dev(p.min_p, torch.float32)
        if p.seeded_rows:
            t.seeded_rows, t.seed_keys = dev(p.seeded_rows, torch.int64), dev(p.seed_keys, torch.int64)
        if p.pen_tokens is not None:
            padded = torch.frombuffer(p.pen_tokens, dtype=torch.int64).view(len(p.pen_prompt_lens), -1)
            t.pen_rows = None if p.pen_rows is None else dev(p.pen_rows, torch.int64)
            t.pen_tokens = padded.pin_memory().to(device, non_blocking=True) if pin else padded.clone()
            if p.pen_late:  # a row's token still in flight goes after its host tokens
                r, c, src = (dev(list(x), torch.int64) for x in zip(*p.pen_late))
                t.pen_tokens[r, c] = prev_tokens.index_select(0, src).to(torch.int64)
            t.pen_prompt_lens = dev(p.pen_prompt_lens, torch.int64)
            t.presence = dev(p.presence, torch.float32)
            t.frequency = dev(p.frequency, torch.float32)
            t.repetition = dev(p.repetition, torch.float32)
        if p.suppress_rows:
            t.suppress_rows, t.suppress_tokens = dev(p.suppress_rows, torch.int64), dev(p.suppress_tokens, torch.int64)
        if p.lp_counts:
            t.lp_rows = None if p.lp_rows is None else dev(p.lp_rows, torch.int64)
            t.lp_rows_list = list(range(len(p.temperatures))) if p.lp_rows is None else p.lp_rows
            t.lp_counts, t.lp_max = p.lp_counts, p.lp_max
        if p.allowed:
            t.allowed_rows = dev([i for i, _ in p.allowed], torch.int64)
            t.allowed_pos = dev([j for j, (_, ids) in enumerate(p.allowed) for _ in ids], torch.int64)
            t.allowed_tokens = dev([tok for _, ids in p.allowed for tok in ids], torch.int64)
        if p.bias:
            t.bias_rows = dev([i for i, b in p.bias for _ in b], torch.int64)
            t.bias_tokens = dev([tok for _, b in p.bias for tok in b], torch.int64)
            t.bias_values = dev([v for _, b in p.bias for v in b.values()], torch.float32)
        if p.processors:
            t.processors = p.processors
        return t


@dataclass
class SamplingPlan:
    """What SamplingTensors holds, as plain lists: built by the engine (which has the requests),
    pickled to the rank that samples when that rank is another process."""
    temperatures: list[float]
    all_greedy: bool
    any_greedy: bool
    top_k: list[int] | None = None
    max_top_k: int = 0
    top_p: list[float] | None = None
    min_p: list[float] | None = None
    seeded_rows: list[int] | None = None
    seed_keys: list[list[int]] | None = None
    pen_rows: list[int] | None = None          # None: every row
    pen_tokens: array | None = None            # [P, L] int64 ('q'), row-major, padded with -1
    pen_late: list[tuple[int, int, int]] | None = None  # (pen row, column, previous step's row)
    pen_prompt_lens: list[int] | None = None
    presence: list[float] | None = None
    frequency: list[float] | None = None
    repetition: list[float] | None = None
    suppress_rows: list[int] | None = None
    suppress_tokens: list[int] | None = None
    lp_rows: list[int] | None = None           # None: every row (when lp_counts is set)
    lp_counts: list[int] | None = None
    lp_max: int | None = None
    allowed: list | None = None                # (row, allowed token ids)
    bias: list | None = None                   # (row, {token: bias})
    processors: list | None = None             # (row, callables, prompt ids, output ids)
    seed: int | None = None                    # plain plans: the fused kernel's noise seed, in [0, 2^31)

    @property
    def plain(self) -> bool:
        """Only temperature / greedy rows: what the fused kernel does on its own (kernels/sampling.py)."""
        return (self.top_k is None and self.top_p is None and self.min_p is None and self.pen_tokens is None
                and not self.suppress_rows and not self.seeded_rows and self.lp_counts is None
                and not self.allowed and not self.bias and not self.processors)

    @classmethod
    def build(cls, seqs, vocab_size: int, eos_token_ids, samples=None, prev_row_of=None,
              seeds: torch.Generator | None = None) -> "SamplingPlan":
        """One per step: a Python loop over the batch reading each request's options.
        `seeds`: where a plain plan draws its seed (the engine's generator, seeded from the
        config; None: torch's default generator).
        `samples[i]`: row i's sample is counted in its sequence's num_inflight (a scheduled step).
        `prev_row_of`: seq_id -> row of the step still in flight, for rows that sampled: such a
        token is not on the host yet, so it counts for seeds and min_tokens, and joins the penalty
        history on the device."""
        counted = samples or [False] * len(seqs)
        temps, top_ks, top_ps, min_ps = [], [], [], []
        pen, supp_rows, supp_toks, seeded, seed_keys, lp_rows, lp_counts = [], [], [], [], [], [], []
        allowed, bias, procs = [], [], []
        use_top_k = use_top_p = use_min_p = False
        eos = list(eos_token_ids)
        for i, seq in enumerate(seqs):
            sp = seq.sampling_params
            # tokens generated before this row's sample (host + in flight, this row's own excluded)
            generated = seq.num_completion_tokens + seq.num_inflight - counted[i]
            greedy = sp.temperature < SAMPLING_EPS
            temps.append(0.0 if greedy else float(sp.temperature))
            k = sp.top_k if 0 < sp.top_k < vocab_size else TOP_K_OFF
            top_ks.append(k)
            top_ps.append(float(sp.top_p))
            min_ps.append(float(sp.min_p))
            if not greedy:
                use_top_k |= k != TOP_K_OFF
                use_top_p |= sp.top_p < 1.0
                use_min_p |= sp.min_p > 0.0
                if sp.seed is not None:
                    seeded.append(i)
                    seed_keys.append(_seed_keys(sp.seed, generated))
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
                if sp.allowed_token_ids is not None:
                    allowed.append((i, sp.allowed_token_ids))
                if sp.logit_bias:
                    bias.append((i, sp.logit_bias))
                if sp.needs_host_tokens and generated != seq.num_completion_tokens:
                    raise RuntimeError("a request with logits_processors or multi-token bad_words was scheduled "
                                       "before the host saw its previous token")
                if sp.bad_words_token_ids:
                    banned = _banned_by_bad_words(sp.bad_words_token_ids, seq.token_ids, seq.num_prompt_tokens)
                    supp_rows.extend([i] * len(banned))
                    supp_toks.extend(banned)
                if sp.logits_processors and (samples is None or samples[i]):
                    n = seq.num_prompt_tokens
                    procs.append((i, sp.logits_processors, seq.token_ids[:n], seq.token_ids[n:]))
        B = len(seqs)
        all_greedy = all(t == 0.0 for t in temps)
        p = cls(temps, all_greedy=all_greedy, any_greedy=any(t == 0.0 for t in temps))
        if not all_greedy:
            if use_top_k:
                p.top_k, p.max_top_k = top_ks, max(k for k in top_ks if k != TOP_K_OFF)
            if use_top_p:
                p.top_p = top_ps
            if use_min_p:
                p.min_p = min_ps
            if seeded:
                p.seeded_rows, p.seed_keys = seeded, seed_keys
        if pen:
            rows = [seqs[i] for i in pen]
            late = [(j, len(s.token_ids), prev_row_of[s.seq_id]) for j, s in enumerate(rows)
                    if prev_row_of and s.seq_id in prev_row_of and s.num_inflight - counted[pen[j]] > 0]
            width = max(len(s.token_ids) for s in rows) + (1 if late else 0)
            flat = array("q")  # C-level copies of the histories: ~2x faster than a list per row
            for s in rows:
                flat.extend(s.token_ids)
                flat.extend([-1] * (width - len(s.token_ids)))
            p.pen_rows = None if len(pen) == B else pen
            p.pen_tokens, p.pen_late = flat, late
            p.pen_prompt_lens = [s.num_prompt_tokens for s in rows]
            p.presence = [s.sampling_params.presence_penalty for s in rows]
            p.frequency = [s.sampling_params.frequency_penalty for s in rows]
            p.repetition = [s.sampling_params.repetition_penalty for s in rows]
        if supp_rows:
            p.suppress_rows, p.suppress_tokens = supp_rows, supp_toks
        if lp_rows:
            p.lp_rows = None if len(lp_rows) == B else lp_rows
            p.lp_counts, p.lp_max = lp_counts, min(max(lp_counts), vocab_size)
        p.allowed, p.bias, p.processors = allowed or None, bias or None, procs or None
        if p.plain:
            p.seed = int(torch.randint(0, 2**31 - 1, (1,), generator=seeds))
        return p


def _banned_by_bad_words(bad_words: list[list[int]], token_ids: list[int], num_prompt: int) -> list[int]:
    """vLLM's rule: a word's last token is banned when the output ends with the tokens before it
    (a one-token word always)."""
    banned = []
    num_output = len(token_ids) - num_prompt
    for word in bad_words:
        k = len(word) - 1
        if k <= num_output and (k == 0 or token_ids[len(token_ids) - k:] == word[:k]):
            banned.append(word[-1])
    return banned


def _seed_keys(seed: int, step: int) -> list[int]:
    """Two 32-bit keys from (seed, step), mixed by splitmix64 on the host."""
    def splitmix64(x):
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return x ^ (x >> 31)

    h = splitmix64(splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ step)
    return [h & _M32, h >> 32]
