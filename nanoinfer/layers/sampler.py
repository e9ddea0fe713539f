"""Batched sampling on the device.

Per step, `SamplingTensors.build` turns the batch's SamplingParams into a few [B]-sized tensors (and,
only for rows that use them, penalty token tensors, min_tokens suppression indices, seeds and
logprob requests). `Sampler.forward` then runs, all batched:

    raw logits --(logprobs: log_softmax of the raw logits, top-N + sampled token's)
      -> logits_processors (per request, its row)        (rows that use them only)
      -> allowed_token_ids: the others -> -inf           (rows that use them only)
      -> bad words, min_tokens (EOS / stop ids) -> -inf  (rows that use them only)
      -> logit_bias                                      (rows that use it only)
      -> repetition, frequency, presence penalties       (rows that use them only)
      -> greedy rows: argmax
      -> / temperature -> min_p -> top_k -> top_p         (skipped when no row uses them)
      -> Gumbel-max sample: argmax(logits / T + G), G = -log(E), E ~ Exp(1)

Requests that use none of the features take the fast path: on CUDA, a fused Triton kernel
(kernels/sampling.py) that reads the logits once for temperature, Gumbel noise and argmax; on CPU,
one division, the noise and an argmax.
Seeded rows draw their noise from a counter-based hash of (seed, step, token id) instead of the
global generator, so a seeded request gets the same tokens whatever else is in the batch, wherever it
sits in it, on CPU and GPU alike. The step is the number of tokens the request generated so far.
"""
import inspect
from array import array
from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.kernels.sampling import sample_gumbel_argmax
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

    @property
    def plain(self) -> bool:
        """Only temperature / greedy rows: what the fused kernel does on its own."""
        return (self.top_k is None and self.top_p is None and self.min_p is None and self.pen_tokens is None
                and self.suppress_rows is None and self.seeded_rows is None and self.lp_max is None
                and self.allowed_rows is None and self.bias_rows is None and self.processors is None)

    @property
    def edits_logits(self) -> bool:
        return (self.suppress_rows is not None or self.pen_tokens is not None or self.allowed_rows is not None
                or self.bias_rows is not None or self.processors is not None)

    @classmethod
    def build(cls, seqs, vocab_size: int, eos_token_ids, device: torch.device, samples=None,
              prev=None) -> "SamplingTensors":
        """One per step, on the host (rank 0): a Python loop over the batch reading each request's
        options; vocabulary-sized work happens only on the device. `samples[i]`: row i's sample
        is counted in its sequence's num_inflight (a scheduled step). `prev` is the step still in
        flight (an InFlight): a token it sampled is not on the host yet, so it counts for seeds and
        min_tokens, and joins the penalty history on the device."""
        pin = device.type == "cuda"
        counted = samples or [False] * len(seqs)

        def dev(data, dtype):
            return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

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
        t = cls(dev(temps, torch.float32), all_greedy=all_greedy, any_greedy=any(t == 0.0 for t in temps))
        if not all_greedy:
            if use_top_k:
                t.top_k = dev(top_ks, torch.int64)
                t.max_top_k = max(k for k in top_ks if k != TOP_K_OFF)
            if use_top_p:
                t.top_p = dev(top_ps, torch.float32)
            if use_min_p:
                t.min_p = dev(min_ps, torch.float32)
            if seeded:
                t.seeded_rows = dev(seeded, torch.int64)
                t.seed_keys = dev(seed_keys, torch.int64)
        if pen:
            rows = [seqs[i] for i in pen]
            # a row's token still in flight (prev) goes after its host tokens, filled in on the device
            late = [(j, len(s.token_ids), prev.row_of[s.seq_id]) for j, s in enumerate(rows)
                    if prev is not None and s.seq_id in prev.row_of and s.num_inflight - counted[pen[j]] > 0]
            width = max(len(s.token_ids) for s in rows) + (1 if late else 0)
            flat = array("q")  # C-level copies of the histories: ~2x faster than a tensor per row
            for s in rows:
                flat.extend(s.token_ids)
                flat.extend([-1] * (width - len(s.token_ids)))
            padded = torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width)
            t.pen_rows = None if len(pen) == B else dev(pen, torch.int64)
            t.pen_tokens = padded.pin_memory().to(device, non_blocking=True) if pin else padded
            if late:
                r, c, src = (dev(list(x), torch.int64) for x in zip(*late))
                t.pen_tokens[r, c] = prev.tokens.index_select(0, src).to(torch.int64)
            t.pen_prompt_lens = dev([s.num_prompt_tokens for s in rows], torch.int64)
            t.presence = dev([s.sampling_params.presence_penalty for s in rows], torch.float32)
            t.frequency = dev([s.sampling_params.frequency_penalty for s in rows], torch.float32)
            t.repetition = dev([s.sampling_params.repetition_penalty for s in rows], torch.float32)
        if supp_rows:
            t.suppress_rows = dev(supp_rows, torch.int64)
            t.suppress_tokens = dev(supp_toks, torch.int64)
        if lp_rows:
            t.lp_rows = None if len(lp_rows) == B else dev(lp_rows, torch.int64)
            t.lp_rows_list, t.lp_counts, t.lp_max = lp_rows, lp_counts, min(max(lp_counts), vocab_size)
        if allowed:
            t.allowed_rows = dev([i for i, _ in allowed], torch.int64)
            t.allowed_pos = dev([j for j, (_, ids) in enumerate(allowed) for _ in ids], torch.int64)
            t.allowed_tokens = dev([tok for _, ids in allowed for tok in ids], torch.int64)
        if bias:
            t.bias_rows = dev([i for i, b in bias for _ in b], torch.int64)
            t.bias_tokens = dev([tok for _, b in bias for tok in b], torch.int64)
            t.bias_values = dev([v for _, b in bias for v in b.values()], torch.float32)
        if procs:
            t.processors = procs
        return t


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


class SamplerOutput(list):
    """The sampled token ids (a plain list, one per row), plus `logprobs`: None when no row asked,
    else one entry per row, None for rows that did not ask, or
    (top_ids, top_logprobs, sampled_logprob, sampled_rank) with the row's own N top entries."""
    logprobs: list | None = None


def _seed_keys(seed: int, step: int) -> list[int]:
    """Two 32-bit keys from (seed, step), mixed by splitmix64 on the host."""
    def splitmix64(x):
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return x ^ (x >> 31)

    h = splitmix64(splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ step)
    return [h & _M32, h >> 32]


def _num_params(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return 2


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values < 2**32; every product stays below
    2**63 (multipliers < 2**31), so there is no signed overflow on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def hashed_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] Exp(1) noise determined by the per-row keys [S, 2] alone (counter-based)."""
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32((_mix32(idx[None, :] ^ keys[:, :1]) + keys[:, 1:]) & _M32)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(u)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        tokens, lp = self.sample(logits, t)
        out = SamplerOutput(tokens.tolist())
        if lp is not None:
            out.logprobs = self.logprobs_to_host(t, len(out), *lp)
        return out

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, t: SamplingTensors):
        """Returns (token ids [B], logprob tensors or None), on the device."""
        if logits.is_cuda and t.plain:
            # the seed from the CPU generator: torch.manual_seed still makes runs repeatable, no sync
            return sample_gumbel_argmax(logits, t.temperatures, int(torch.randint(0, 2**31 - 1, (1,)))), None
        raw = logits
        logits = logits.float()
        if logits is raw and t.edits_logits:
            logits = logits.clone()  # edited in place below: leave the caller's tensor alone
        lp = None
        if t.lp_max is not None:
            lp = torch.log_softmax(logits if t.lp_rows is None else logits[t.lp_rows], dim=-1)
        if t.processors is not None:
            self._apply_processors(logits, t.processors)
        if t.allowed_rows is not None:
            keep = torch.zeros(t.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[t.allowed_pos, t.allowed_tokens] = True
            logits[t.allowed_rows] = logits[t.allowed_rows].masked_fill(~keep, float("-inf"))
        if t.suppress_rows is not None:
            logits[t.suppress_rows, t.suppress_tokens] = float("-inf")
        if t.bias_rows is not None:
            logits.index_put_((t.bias_rows, t.bias_tokens), t.bias_values, accumulate=True)
        if t.pen_tokens is not None:
            self._apply_penalties(logits, t)
        greedy = logits.argmax(dim=-1) if t.any_greedy else None
        if t.all_greedy:
            tokens = greedy
        else:
            tokens = self._sample_random(logits, t)
            if greedy is not None:
                tokens = torch.where(t.temperatures == 0, greedy, tokens)
        if lp is None:
            return tokens, None
        sampled = tokens if t.lp_rows is None else tokens[t.lp_rows]
        sampled_lp = lp.gather(1, sampled[:, None])
        rank = (lp > sampled_lp).sum(dim=-1) + 1
        top_lp, top_ids = lp.topk(t.lp_max, dim=-1)
        return tokens, (top_ids, top_lp, sampled_lp[:, 0], rank)

    @staticmethod
    def _apply_processors(logits: torch.Tensor, processors: list):
        """vLLM's per-request logits processors: fn(output_ids, row), or fn(prompt_ids, output_ids,
        row) when it takes three parameters; each returns the row to use."""
        for row, fns, prompt_ids, output_ids in processors:
            x = logits[row]
            for fn in fns:
                x = fn(prompt_ids, list(output_ids), x) if _num_params(fn) == 3 else fn(list(output_ids), x)
            logits[row] = x

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, t: SamplingTensors):
        """vLLM's order: repetition (prompt + output tokens), then frequency and presence (output
        tokens), from token counts built with one scatter_add over the padded [P, L] token tensor."""
        rows = logits if t.pen_rows is None else logits[t.pen_rows]
        P, V = rows.shape
        tokens = t.pen_tokens.masked_fill(t.pen_tokens < 0, V)  # padding -> an extra column, dropped
        pos = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        is_output = pos >= t.pen_prompt_lens[:, None]
        out_tokens = torch.where(is_output, tokens, V)
        counts = torch.zeros(P, V + 1, dtype=torch.float32, device=rows.device)
        counts.scatter_add_(1, out_tokens, torch.ones_like(out_tokens, dtype=torch.float32))
        counts = counts[:, :V]
        seen = torch.zeros(P, V + 1, dtype=torch.bool, device=rows.device)
        seen.scatter_(1, tokens, True)
        seen = seen[:, :V]
        rep = t.repetition[:, None]
        penalized = torch.where(rows > 0, rows / rep, rows * rep)
        rows = torch.where(seen, penalized, rows)
        rows -= t.frequency[:, None] * counts
        rows -= t.presence[:, None] * (counts > 0)
        if t.pen_rows is None:
            logits.copy_(rows)
        else:
            logits[t.pen_rows] = rows

    @staticmethod
    def _sample_random(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        temps = torch.where(t.temperatures < SAMPLING_EPS, 1.0, t.temperatures)
        x = logits / temps[:, None]
        neg_inf = float("-inf")
        if t.min_p is not None:  # p < min_p * p_max  <=>  x < x_max + log(min_p)
            thresh = x.amax(dim=-1, keepdim=True) + torch.log(t.min_p)[:, None]
            x.masked_fill_(x < thresh, neg_inf)
        if t.top_p is not None:  # sort once; top_k then top_p in sorted order
            sorted_x, order = x.sort(dim=-1, descending=True)
            pos = torch.arange(x.shape[1], device=x.device)[None, :]
            if t.top_k is not None:
                sorted_x.masked_fill_(pos >= t.top_k[:, None], neg_inf)
            probs = torch.softmax(sorted_x, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = (mass_before >= t.top_p[:, None]) & (t.top_p[:, None] < 1.0) & (pos > 0)
            sorted_x.masked_fill_(drop, neg_inf)
            x = torch.empty_like(x).scatter_(1, order, sorted_x)
        elif t.top_k is not None:  # the k-th largest value is the threshold (ties kept)
            if t.max_top_k <= 1024:
                top = x.topk(t.max_top_k, dim=-1).values
            else:
                top = x.sort(dim=-1, descending=True).values
            kth = top.gather(1, (t.top_k.clamp(max=top.shape[1]) - 1)[:, None])
            kth = torch.where(t.top_k[:, None] >= TOP_K_OFF, neg_inf, kth)
            x.masked_fill_(x < kth, neg_inf)
        noise = torch.empty_like(x).exponential_()
        if t.seeded_rows is not None:
            noise[t.seeded_rows] = hashed_exponential(t.seed_keys, x.shape[1])
        # argmax(x - log E) == argmax(softmax(x) / E): a sample of softmax(x)
        return (x - noise.clamp_min_(1e-10).log_()).argmax(dim=-1)

    @staticmethod
    def logprobs_to_host(t: SamplingTensors, batch: int, top_ids, top_lp, sampled_lp, rank):
        top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        sampled_lp, rank = sampled_lp.tolist(), rank.tolist()
        out = [None] * batch
        for j, (row, n) in enumerate(zip(t.lp_rows_list, t.lp_counts)):
            out[row] = (top_ids[j][:n], top_lp[j][:n], sampled_lp[j], rank[j])
        return out
