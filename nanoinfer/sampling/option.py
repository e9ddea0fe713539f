"""The seam of the per-request logits options, as vLLM V1 attaches its built-in logits processors:
penalties, token constraints, suppressed tokens, user logits processors and grammar masks each live
in their feature's folder, registered by the composition place (Composition.sampling_options).

    the engine, every step    SamplingOption.uses(sp), once per SamplingParams object; then
                              SamplingOption.plan(rows, ctx) for the rows that use it: a payload
    the sampling rank         OptionPayload.to_device(t, rank): its tensors into SamplingTensors
    the logits pipeline       OptionPayload.stages: its Stages, placed by their order

A payload's class carries its device side, so a rank that unpickles a plan (tensor parallelism)
needs no registry: unpickling imports the option's module.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoinfer.sampling.column_cache import ColumnCache


@dataclass(frozen=True, slots=True)
class Stage:
    """One entry of the logits pipeline. `applies(t)`: whether this step's rows use it, read from
    SamplingTensors' host-side fields, so that deciding costs no device sync. `run(logits, t)`: edits
    the [B, V] float32 logits in place, only the rows that use it; an end (`end=True`) returns the
    tokens [B] instead, and the pipeline stops at the first end that applies. `order`: its place in
    vLLM's order among the options' stages."""
    name: str
    applies: Callable[..., bool]                        # (SamplingTensors)
    run: Callable[..., torch.Tensor | None]             # (logits, SamplingTensors)
    end: bool = False
    order: int = 0


class PlanRows:
    """What an option's host part reads of the step (one per step that some option plans)."""
    __slots__ = ("seqs", "samples", "counted", "prev_row_of", "eos", "vocab_size", "masks_later")

    def __init__(self, seqs, samples, counted, prev_row_of, eos, vocab_size, masks_later):
        self.seqs, self.samples, self.counted, self.prev_row_of = seqs, samples, counted, prev_row_of
        self.eos, self.vocab_size, self.masks_later = eos, vocab_size, masks_later

    def generated(self, i: int) -> int:
        """Tokens generated before row i's sample (on the host and in flight, its own excluded)."""
        seq = self.seqs[i]
        return seq.num_completion_tokens + seq.num_inflight - self.counted[i]

    def sampled(self, i: int) -> bool:
        """Whether row i samples a token (a row of a prompt's earlier chunk does not)."""
        return self.samples is None or self.samples[i]

    def check_host_tokens(self, i: int) -> None:
        """An option that reads row i's tokens on the host: none may be in flight."""
        if self.generated(i) != self.seqs[i].num_completion_tokens:
            raise RuntimeError("a request whose sampling options read its tokens on the host (logits processors, "
                               "bad words, a grammar) was scheduled before the host saw its previous token")


class SamplingOption:
    """An option's host side, one per engine (it may keep state: what the sampling rank holds)."""
    name = ""
    stages = ()  # its Stages, as its payloads bring them (the whole pipeline of a registered set)
    pending = False  # True: plan() is called even when no row uses the option (its state to send)
    # the SamplingParams fields uses() reads, and values with which it is False: a SamplingParams
    # whose fields all have them (a plain request) is not asked (one C-level read for all options)
    off: dict = {}

    def uses(self, sp) -> bool:
        """Whether rows of this SamplingParams need the option (it does not depend on progress)."""
        raise NotImplementedError

    def plan(self, rows: list[int], ctx: PlanRows):
        """The step's payload for `rows` (those that use it), or None."""
        raise NotImplementedError

    def unschedule(self) -> None:
        """The plan last built was not launched."""


class OptionPayload:
    """A step's part of an option in the plan: plain lists and C arrays (it pickles cheaply)."""
    __slots__ = ()
    name = ""  # its option's name (SamplingPlan.payload finds it by this)
    stages = ()  # the Stages that edit the logits (each runs when it applies)
    before_fused = False  # its edit is a token mask the fused kernel may follow (SamplingPlan.fused)
    eager = False  # it runs user code: the step samples (and may fail) at once

    @property
    def edits(self) -> bool:
        """Whether it edits this step's logits (False: it only updates what the rank holds)."""
        return True

    def to_device(self, t, rank: "RankTensors") -> None:
        """Its tensors into SamplingTensors `t` (t.options[name], or the fields it fills)."""
        raise NotImplementedError


class RankTensors:
    """Where a step's option tensors are made on the sampling rank: `columns`, the per-row columns
    kept from the last step; `states`, what the rank holds for each option from step to step (by
    name, as the token constraints' store); `prev_tokens`, the tokens of the step in flight."""
    __slots__ = ("device", "columns", "states", "prev_tokens")

    def __init__(self, device: torch.device, columns: ColumnCache, states: dict | None, prev_tokens):
        self.device, self.columns, self.prev_tokens = device, columns, prev_tokens
        self.states = {} if states is None else states
