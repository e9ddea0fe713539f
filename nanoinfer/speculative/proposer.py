"""The proposer interface: what guesses a speculative row's next tokens.

A proposer sees the scheduled speculative rows (their sequences, with every token on the host, and
how many tokens each may propose) and returns each row's proposals, any number up to that, the
most likely first. The verifier (speculative/rows.py, accepted_runs) stays exact for proposals that are
deterministic given the sequence, or drawn with noise either independent of the target's at that
position or the very same (a request's seeded noise). The KV blocks of the row's lookahead
positions are reserved in the sequence's block table before `propose` is called.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable


@dataclass(slots=True)
class DeviceProposals:
    """Proposals left on the device, with the query they extend: row i (the sequence `seq_ids[i]`)
    holds its first query token, then its lengths[i] proposals, in tokens[i, :1 + lengths[i]]. The
    target step reads them there (device_inputs.py, DeviceTokens), so it is
    launched without waiting for them. `finish` waits for their host copy and returns the
    proposals as lists, row by row."""
    tokens: object  # a [rows, 1 + width] int64 device tensor
    finish: Callable[[], list[list[int]]]
    seq_ids: list[int]
    lengths: list[int]
    # [rows] int64 on the device, or None (all 0): how far each row's positions lie before the
    # scheduled ones (a row chained onto one in flight, speculative/chaining.py)
    offsets: object = None
    first_samples: list[int] | None = None  # each row's first sampling row in the verify step (Speculator)
    index: dict[int, int] = field(init=False)  # seq_id -> row

    def __post_init__(self):
        self.index = {s: i for i, s in enumerate(self.seq_ids)}


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list, max_lens: list[int]) -> list[list[int]]:
        """Proposals for each sequence, at most max_lens[i] tokens for sequence i."""

    def launches(self, seq) -> bool:
        """Whether `launch` serves the sequence: only requests whose sampling plan does not read
        the proposals (greedy, no penalties or token constraints), since the verify step's plan is
        built before they reach the host."""
        return False

    def launch(self, seqs: list, max_lens: list[int], lengths: list[int], chained=None) -> DeviceProposals:
        """Exactly max_lens[i] proposals for each sequence (`launches` holds for each), left on the
        device. lengths[i]: sequence i's length as scheduled. `chained` (speculative/chaining.py,
        ChainedRows): the rows chained onto one still in flight, whose last two tokens and shift
        are on the device."""
        raise NotImplementedError

    def exit(self):
        """Release what the proposer holds (a draft model's weights and KV cache)."""


class HiddenStateProposer(Proposer):
    """For a head that reads the target's hidden states (EAGLE, MTP): the engine hands it the
    target's final hidden states of each sequence's last verified positions before `propose`.
    No proposer of this kind exists yet; the engine's seam for it is `observe`."""

    @abstractmethod
    def observe(self, seq_ids: list[int], hidden_states) -> None:
        """The target's hidden states [rows, hidden] at the last accepted position of each sequence."""
