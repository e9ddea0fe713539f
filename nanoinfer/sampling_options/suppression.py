"""Suppressed tokens, a per-request option (sampling/option.py): min_tokens (EOS and the stop ids
while a request has generated fewer) and the bad words of several tokens (a word's last token,
right after the tokens before it: they read the host's token history, through the index the token
constraints' registry keeps per request). The one-token bad words are token constraints kept on the
sampling rank (token_constraints.py); this stage sets both to -inf.
"""
from dataclasses import dataclass

import torch

from nanoinfer.sampling.option import OptionPayload, PlanRows, RankTensors, SamplingOption, Stage
from nanoinfer.sampling_options.constraint_registry import TokenConstraintRegistry
from nanoinfer.sampling_options.constraint_store import CONSTRAINTS
from nanoinfer.utils.device_copy import to_device

NAME = "suppression"


def _banned_one_token(t):
    c = t.options.get(CONSTRAINTS)
    return c is not None and c.banned_rows is not None


def apply_suppression(logits: torch.Tensor, t) -> None:
    """Bad words (their banned last tokens) and min_tokens (EOS and stop ids) -> -inf."""
    if NAME in t.options:
        logits[t.options[NAME]] = float("-inf")
    if _banned_one_token(t):
        c = t.options[CONSTRAINTS]
        logits[c.banned_rows, c.banned_tokens] = float("-inf")


SUPPRESSION = Stage("bad_words, min_tokens", lambda t: NAME in t.options or _banned_one_token(t), apply_suppression,
                    order=40)


@dataclass(slots=True)
class SuppressedTokens(OptionPayload):
    """logits[rows[j], tokens[j]] = -inf."""
    name, stages = NAME, (SUPPRESSION,)

    rows: list[int]
    tokens: list[int]

    def to_device(self, t, rank: RankTensors) -> None:
        t.options[NAME] = (to_device(self.rows, torch.int64, rank.device),
                           to_device(self.tokens, torch.int64, rank.device))


class Suppression(SamplingOption):
    """`registry`: the token constraints' (it indexes each request's bad words once)."""
    name, stages = NAME, (SUPPRESSION,)
    off = {"min_tokens": 0, "has_token_constraints": False}  # (the flag: bad words among others)

    def __init__(self, registry: TokenConstraintRegistry):
        self.registry = registry

    def uses(self, sp) -> bool:
        return bool(sp.min_tokens) or sp._has_multi_token_bad_words()

    def plan(self, rows: list[int], ctx: PlanRows) -> SuppressedTokens | None:
        out_rows, out_tokens = [], []
        for i in rows:
            seq = ctx.seqs[i]
            sp = seq.sampling_params
            ids = ()
            if sp.min_tokens and ctx.generated(i) < sp.min_tokens:
                ids = sp.stop_token_ids if sp.ignore_eos else ctx.eos + sp.stop_token_ids
            if sp._has_multi_token_bad_words():  # (one-token words are token constraints)
                ctx.check_host_tokens(i)
                ids = [*ids, *self.registry.banned_after(sp, seq.token_ids, seq.num_prompt_tokens)]
            out_rows.extend([i] * len(ids))
            out_tokens.extend(ids)
        return SuppressedTokens(out_rows, out_tokens) if out_rows else None
