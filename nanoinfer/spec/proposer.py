"""The proposer interface: what guesses a speculative row's next tokens.

A proposer sees the scheduled speculative rows (their sequences, with every token on the host, and
how many tokens each may propose) and returns each row's proposals, any number up to that, the
most likely first. The verifier (spec/rows.py, accepted_runs) stays exact for proposals that are
deterministic given the sequence, or drawn with noise either independent of the target's at that
position or the very same (a request's seeded noise). The KV blocks of the row's lookahead
positions are reserved in the sequence's block table before `propose` is called.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class DeviceProposals:
    """Proposals left on the device: row i's max_lens[i] tokens (launch's) are tokens[i, :max_lens[i]],
    which the target step reads there (its inputs name them: StepInput.proposal_rows), so it is
    launched without waiting for them. `finish` waits for their host copy and returns them as lists."""
    tokens: object  # a [rows, width] int64 device tensor
    finish: Callable[[], list[list[int]]]


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list, max_lens: list[int]) -> list[list[int]]:
        """Proposals for each sequence, at most max_lens[i] tokens for sequence i."""

    def launch(self, seqs: list, max_lens: list[int]) -> DeviceProposals | None:
        """Exactly max_lens[i] proposals for each sequence, left on the device; None where this
        proposer cannot for these sequences (propose() serves them). Only for requests whose
        sampling plan does not read the proposals (greedy, no penalties or token constraints): the
        verify step's plan is built before they reach the host."""
        return None

    def exit(self):
        """Release what the proposer holds (a draft model's weights and KV cache)."""


class HiddenStateProposer(Proposer):
    """For a head that reads the target's hidden states (EAGLE, MTP): the engine hands it the
    target's final hidden states of each sequence's last verified positions before `propose`.
    No proposer of this kind exists yet; the engine's seam for it is `observe`."""

    @abstractmethod
    def observe(self, seq_ids: list[int], hidden_states) -> None:
        """The target's hidden states [rows, hidden] at the last accepted position of each sequence."""
