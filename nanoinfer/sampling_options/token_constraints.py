"""allowed_token_ids, logit_bias and the one-token bad words, a per-request option
(sampling/option.py). They do not change while a request runs: the registry (constraint_registry.py)
sends them to the sampling rank with the first step that uses them, and each step after names them
by key; the rank keeps them on its device (constraint_store.py), its state for this option.
"""
from dataclasses import dataclass

import torch

from nanoinfer.sampling.option import OptionPayload, PlanRows, RankTensors, SamplingOption, Stage
from nanoinfer.sampling_options.constraint_registry import TokenConstraintRegistry
from nanoinfer.sampling_options.constraint_store import CONSTRAINTS, StepConstraints, TokenConstraintStore
from nanoinfer.sampling_options.suppression import SUPPRESSION


def apply_allowed_tokens(logits: torch.Tensor, t) -> None:
    """allowed_token_ids: every other token of those rows -> -inf."""
    c: StepConstraints = t.options[CONSTRAINTS]
    keep = torch.zeros(c.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[c.allowed_pos, c.allowed_tokens] = True
    logits[c.allowed_rows] = logits[c.allowed_rows].masked_fill(~keep, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, t) -> None:
    c: StepConstraints = t.options[CONSTRAINTS]
    logits.index_put_((c.bias_rows, c.bias_tokens), c.bias_values, accumulate=True)


def _has(t, name: str) -> bool:
    c = t.options.get(CONSTRAINTS)
    return c is not None and getattr(c, name) is not None


ALLOWED_TOKENS = Stage("allowed_token_ids", lambda t: _has(t, "allowed_rows"), apply_allowed_tokens, order=20)
LOGIT_BIAS = Stage("logit_bias", lambda t: _has(t, "bias_rows"), apply_logit_bias, order=50)


def rank_store(states: dict, device: torch.device) -> TokenConstraintStore:
    """The sampling rank's store, in its options' `states` (sampling/option.py, RankTensors.state)."""
    store = states.get(CONSTRAINTS)
    if store is None:
        store = states[CONSTRAINTS] = TokenConstraintStore(device)
    return store


@dataclass(slots=True)
class ConstraintRows(OptionPayload):
    """Rows `rows` under keys `keys`; `new`: key -> TokenConstraints the rank has not got yet;
    `dropped`: keys no request uses any more (freed after this step)."""
    name, stages = CONSTRAINTS, (ALLOWED_TOKENS, SUPPRESSION, LOGIT_BIAS)

    rows: list[int]
    keys: list[int]
    new: dict | None
    dropped: list[int] | None

    @property
    def edits(self) -> bool:
        return bool(self.rows)

    def to_device(self, t, rank: RankTensors) -> None:
        store = rank_store(rank.states, rank.device)
        store.update(self.new)
        if self.rows:
            t.options[CONSTRAINTS] = store.gather(self.rows, self.keys)
        store.drop(self.dropped)  # (after the gather: a one-plan store's keys go now)


class TokenConstraintsOption(SamplingOption):
    """`ephemeral`: for one plan at a time (tests, benchmarks); `store`: the rank's store, when it
    is in this process (a draft model's: constraint_registry.py)."""
    name, stages = CONSTRAINTS, ConstraintRows.stages
    off = {"has_token_constraints": False}  # (SamplingParams' flag: any per-token-id option)

    def __init__(self, ephemeral: bool = False, store: TokenConstraintStore | None = None):
        self.registry = TokenConstraintRegistry(ephemeral, store)

    @property
    def pending(self) -> bool:
        return self.registry.pending

    def uses(self, sp) -> bool:
        return sp.allowed_token_ids is not None or bool(sp.logit_bias) or bool(sp.bad_words_token_ids)

    def plan(self, rows: list[int], ctx: PlanRows) -> ConstraintRows | None:
        registry = self.registry
        registry.start_plan()
        keyed, keys = [], []
        for i in rows:
            key = registry.key_for(ctx.seqs[i].sampling_params)
            if key is not None:
                keyed.append(i)
                keys.append(key)
        new, dropped = registry.take_updates()
        return ConstraintRows(keyed, keys, new, dropped) if keyed or new or dropped else None

    def unschedule(self) -> None:
        self.registry.unschedule()
