"""The repetition, frequency and presence penalties, a per-request option (sampling/option.py).

The host sends each penalised row's token history, padded into one flat [P, L] int64 buffer (C-level
copies, not a Python list per row); a row whose last token is still in flight gets a late entry,
and the device writes that token after its history. The device counts the tokens with one
scatter_add and applies the penalties in vLLM's order.
"""
from array import array
from dataclasses import dataclass

import torch

from nanoinfer.sampling.option import OptionPayload, PlanRows, RankTensors, SamplingOption, Stage
from nanoinfer.utils.device_copy import tensor_to_device, to_device

NAME = "penalties"


@dataclass(slots=True)
class PenaltyTensors:
    rows: torch.Tensor | None              # None: every row
    tokens: torch.Tensor                   # [P, L] int64 prompt + output token ids, padded with -1
    prompt_lens: torch.Tensor              # [P] int64
    presence: torch.Tensor                 # [P] float32
    frequency: torch.Tensor
    repetition: torch.Tensor


def apply_penalties(logits: torch.Tensor, t) -> None:
    """vLLM's order: repetition (prompt + output tokens), then frequency and presence (output
    tokens), from token counts built with one scatter_add over the padded [P, L] token tensor."""
    p: PenaltyTensors = t.options[NAME]
    rows = logits if p.rows is None else logits[p.rows]
    P, V = rows.shape
    tokens = p.tokens.masked_fill(p.tokens < 0, V)  # padding -> an extra column, dropped
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    is_output = pos >= p.prompt_lens[:, None]
    out_tokens = torch.where(is_output, tokens, V)
    counts = torch.zeros(P, V + 1, dtype=torch.float32, device=rows.device)
    counts.scatter_add_(1, out_tokens, torch.ones_like(out_tokens, dtype=torch.float32))
    counts = counts[:, :V]
    seen = torch.zeros(P, V + 1, dtype=torch.bool, device=rows.device)
    seen.scatter_(1, tokens, True)
    seen = seen[:, :V]
    rep = p.repetition[:, None]
    penalized = torch.where(rows > 0, rows / rep, rows * rep)
    rows = torch.where(seen, penalized, rows)
    rows -= p.frequency[:, None] * counts
    rows -= p.presence[:, None] * (counts > 0)
    if p.rows is None:
        logits.copy_(rows)
    else:
        logits[p.rows] = rows


PENALTIES = Stage(NAME, lambda t: NAME in t.options, apply_penalties, order=60)


@dataclass(slots=True)
class PenaltyRows(OptionPayload):
    name, stages = NAME, (PENALTIES,)

    rows: list[int] | None                 # None: every row
    tokens: array                          # [P, L] int64 ('q'), row-major, padded with -1
    late: list[tuple[int, int, int]]       # (penalty row, column, previous step's row)
    prompt_lens: list[int]
    presence: list[float]
    frequency: list[float]
    repetition: list[float]

    def to_device(self, t, rank: RankTensors) -> None:
        padded = torch.frombuffer(self.tokens, dtype=torch.int64).view(len(self.prompt_lens), -1)
        tokens = tensor_to_device(padded, rank.device) if rank.device.type == "cuda" else padded.clone()
        if self.late:  # a row's token still in flight goes after its host tokens
            r, c, src = (to_device(list(x), torch.int64, rank.device) for x in zip(*self.late))
            tokens[r, c] = rank.prev_tokens.index_select(0, src).to(torch.int64)
        t.options[NAME] = PenaltyTensors(
            None if self.rows is None else to_device(self.rows, torch.int64, rank.device), tokens,
            rank.columns.get("pen_prompt_lens", self.prompt_lens, torch.int64),
            rank.columns.get("presence", self.presence, torch.float32),
            rank.columns.get("frequency", self.frequency, torch.float32),
            rank.columns.get("repetition", self.repetition, torch.float32))


class Penalties(SamplingOption):
    name, stages = NAME, (PENALTIES,)
    off = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}

    def uses(self, sp) -> bool:
        return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0

    def plan(self, rows: list[int], ctx: PlanRows) -> PenaltyRows:
        seqs = [ctx.seqs[i] for i in rows]
        prev = ctx.prev_row_of
        late = [(j, len(s.token_ids), prev[s.seq_id]) for j, s in enumerate(seqs)
                if prev and s.seq_id in prev and s.num_inflight - ctx.counted[rows[j]] > 0]
        width = max(len(s.token_ids) for s in seqs) + (1 if late else 0)
        flat = array("q")
        for s in seqs:
            flat.extend(s.token_ids)
            flat.extend([-1] * (width - len(s.token_ids)))
        params = [s.sampling_params for s in seqs]
        return PenaltyRows(None if len(rows) == len(ctx.seqs) else rows, flat, late,
                           [s.num_prompt_tokens for s in seqs], [sp.presence_penalty for sp in params],
                           [sp.frequency_penalty for sp in params], [sp.repetition_penalty for sp in params])
