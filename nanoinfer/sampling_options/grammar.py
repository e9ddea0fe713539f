"""Structured outputs' part of sampling, a per-request option (sampling/option.py): the rows a
grammar constrains and their next-token bitmasks, applied to the logits after allowed_token_ids.
(Here, not in structured/, which the API's SamplingParams imports: so structured/ needs nothing of
the sampling core, and the feature finds the plan's rows by the option's name.)

Each row's matcher advances over its new tokens, then fills its mask (structured/grammar_state.py):
when the plan is built (tensor parallelism), or, with `masks_later` (one rank), by the engine once
the forward is launched (structured/step_masks.py): the plan then names the rows and leaves the
bitmask None. The masks are the sampling rank's token mask (SamplingTensors.grammar_rows,
grammar_bitmask), which the fused kernel may follow.
"""
from dataclasses import dataclass

import torch

from nanoinfer.sampling.option import OptionPayload, PlanRows, RankTensors, SamplingOption, Stage
from nanoinfer.sampling_options.token_mask import apply_token_bitmask
from nanoinfer.structured.feature import GRAMMAR_OPTION
from nanoinfer.structured.grammar_state import fill_bitmasks
from nanoinfer.utils.device_copy import tensor_to_device, to_device

NAME = GRAMMAR_OPTION


def apply_grammar(logits: torch.Tensor, t) -> None:
    """Every token the row's grammar does not allow next -> -inf."""
    apply_token_bitmask(logits, t.grammar_rows, t.grammar_bitmask)


GRAMMAR = Stage(NAME, lambda t: t.grammar_rows is not None, apply_grammar, order=30)


@dataclass(slots=True)
class GrammarRows(OptionPayload):
    """The rows a grammar constrains; their next-token bitmasks, [G, ceil(V / 32)] int32 words
    (None: given after the forward's launch)."""
    name, stages = NAME, (GRAMMAR,)
    before_fused = True

    rows: list[int]
    bitmask: bytes | None

    def to_device(self, t, rank: RankTensors) -> None:
        t.grammar_rows = to_device(self.rows, torch.int64, rank.device)
        if self.bitmask is not None:  # (None: set_grammar_bitmask, after the forward's launch)
            words = torch.frombuffer(bytearray(self.bitmask), dtype=torch.int32).view(len(self.rows), -1)
            t.grammar_bitmask = tensor_to_device(words, rank.device)


class GrammarOption(SamplingOption):
    name, stages = NAME, (GRAMMAR,)
    off = {"has_token_constraints": False}  # (SamplingParams' flag: any per-token-id option)

    def uses(self, sp) -> bool:
        return sp.structured_outputs is not None

    def plan(self, rows: list[int], ctx: PlanRows) -> GrammarRows | None:
        if not ctx.masks_later:  # (the plan fills the masks: the host must have every token)
            for i in rows:
                ctx.check_host_tokens(i)
        rows = [i for i in rows if ctx.sampled(i)]
        if not rows:
            return None
        if ctx.masks_later:
            return GrammarRows(rows, None)
        return GrammarRows(rows, fill_bitmasks([ctx.seqs[i] for i in rows], ctx.vocab_size))
