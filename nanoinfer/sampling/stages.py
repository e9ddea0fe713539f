"""The per-request logits edits, each a Stage of the pipeline (sampling/pipeline.py orders them):
logits processors, allowed_token_ids, grammar bitmasks (structured outputs), suppressed tokens
(bad words, min_tokens), logit_bias and the repetition / frequency / presence penalties. Each
touches only the rows that asked for it, batched over those rows; vocabulary-sized work stays on
the device.
"""
import inspect
import logging

import torch

from nanoinfer.sampling.stage import Stage
from nanoinfer.sampling.tensors import SamplingTensors
from nanoinfer.sampling.token_mask import apply_token_bitmask

logger = logging.getLogger("nanoinfer")


def _num_params(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return 2


def apply_processors(logits: torch.Tensor, t: SamplingTensors) -> None:
    """vLLM's per-request logits processors: fn(output_ids, row), or fn(prompt_ids, output_ids,
    row) when it takes three parameters; each returns the row to use. One that raises (or returns
    what does not fit the row) fails its own request only: the row is left with no token to sample,
    which the pipeline marks NON_FINITE, and the engine finishes the request with "error"."""
    for row, fns, prompt_ids, output_ids in t.processors:
        try:
            x = logits[row]
            for fn in fns:
                x = fn(prompt_ids, list(output_ids), x) if _num_params(fn) == 3 else fn(list(output_ids), x)
            logits[row] = x
        except Exception as e:
            logger.warning("a logits processor raised on sampling row %d; its request fails: %s: %s",
                           row, type(e).__name__, e)
            logits[row] = float("-inf")


def apply_allowed_tokens(logits: torch.Tensor, t: SamplingTensors) -> None:
    """allowed_token_ids: every other token of those rows -> -inf."""
    c = t.constraints
    keep = torch.zeros(c.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[c.allowed_pos, c.allowed_tokens] = True
    logits[c.allowed_rows] = logits[c.allowed_rows].masked_fill(~keep, float("-inf"))


def apply_grammar(logits: torch.Tensor, t: SamplingTensors) -> None:
    """Structured outputs: every token the row's grammar does not allow next -> -inf."""
    apply_token_bitmask(logits, t.grammar_rows, t.grammar_bitmask)


def apply_suppression(logits: torch.Tensor, t: SamplingTensors) -> None:
    """Bad words (their banned last tokens) and min_tokens (EOS and stop ids) -> -inf."""
    if t.suppress_rows is not None:
        logits[t.suppress_rows, t.suppress_tokens] = float("-inf")
    if t.constraints.banned_rows is not None:
        logits[t.constraints.banned_rows, t.constraints.banned_tokens] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, t: SamplingTensors) -> None:
    c = t.constraints
    logits.index_put_((c.bias_rows, c.bias_tokens), c.bias_values, accumulate=True)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> None:
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


PROCESSORS = Stage("logits_processors", lambda t: t.processors is not None, apply_processors)
ALLOWED_TOKENS = Stage("allowed_token_ids", lambda t: t.constraints.allowed_rows is not None, apply_allowed_tokens)
GRAMMAR = Stage("structured_outputs", lambda t: t.grammar_rows is not None, apply_grammar)
SUPPRESSION = Stage("bad_words, min_tokens", lambda t: t.suppress_rows is not None or t.constraints.banned_rows is not None,
                    apply_suppression)
LOGIT_BIAS = Stage("logit_bias", lambda t: t.constraints.bias_rows is not None, apply_logit_bias)
PENALTIES = Stage("penalties", lambda t: t.pen_tokens is not None, apply_penalties)
