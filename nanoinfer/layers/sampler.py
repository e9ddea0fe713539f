"""Batched sampling on the device.

Per step, the engine's SamplingPlan becomes SamplingTensors (layers/sampling_tensors.py): a few
[B]-sized tensors (and, only for rows that use them, penalty token tensors, min_tokens suppression
indices, seeds and logprob requests). `Sampler.forward` then runs, all batched:

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
(kernels/sampling.py) that reads the logits once for temperature, Gumbel noise and argmax, its
noise seeded per step from the engine's generator (seeded from the config's seed); on CPU, one
division, the noise and an argmax. With tensor parallelism on CUDA, such steps are sampled on every
rank's shard of the vocabulary (sample_vocab_shard).
Seeded rows draw their noise from a counter-based hash of (seed, step, token id) instead of torch's
generator, so a seeded request gets the same tokens whatever else is in the batch, wherever it
sits in it, on CPU and GPU alike. The step is the number of tokens the request generated so far.
"""
import inspect

import torch
import torch.distributed as dist
from torch import nn

from nanoinfer.kernels.sampling import gumbel_argmax_partials, pick_token, sample_gumbel_argmax
from nanoinfer.layers.sampling_tensors import TOP_K_OFF, SamplingTensors
from nanoinfer.sampling_params import SAMPLING_EPS

_M32 = 0xFFFFFFFF


class SamplerOutput(list):
    """The sampled token ids (a plain list, one per row), plus `logprobs`: None when no row asked,
    else one entry per row, None for rows that did not ask, or
    (top_ids, top_logprobs, sampled_logprob, sampled_rank) with the row's own N top entries."""
    logprobs: list | None = None


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


def sample_vocab_shard(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col0: int) -> torch.Tensor:
    """Tensor parallelism on CUDA, a step whose rows use temperature alone (SamplingPlan.plain):
    each rank samples its shard of the vocabulary (`logits`, columns from col0), the ranks
    all-gather their rows' per-chunk winners (a few bytes a row, where gathering the logits moves
    ~39 MB at 256 rows of an 8B model), and every rank picks the same tokens: those the fused
    kernel takes on the full rows with this seed. Returns them [B] int64, on every rank."""
    parts = gumbel_argmax_partials(logits, temperatures, seed, col0)
    everyone = parts.new_empty((dist.get_world_size(), *parts.shape))
    dist.all_gather_into_tensor(everyone, parts)
    return pick_token(everyone)


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
            return sample_gumbel_argmax(logits, t.temperatures, t.seed), None
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
