"""When speculation is turned off, because it would lose:

- more than `disable_by_batch_size` sequences running (vLLM's option): a large batch is bound by
  compute rather than by reading the weights, so verifying k extra tokens per row costs about k
  extra rows' worth of time, more than the accepted tokens win back;
- a sequence whose acceptance rate, once it has had `MIN_PROPOSALS` proposals, is below
  `disable_below_acceptance`: each of its steps would pay for proposals (and a draft model's
  forwards) that are rejected, and for not overlapping. A step that found no proposal counts as
  one rejected proposal (n-gram lookup on text that never repeats). It then decodes plainly, and
  overlapped, to its end.
"""
import weakref

MIN_PROPOSALS = 16  # proposals a sequence is judged on


class SpeculationPolicy:
    def __init__(self, disable_by_batch_size: int | None, disable_below_acceptance: float):
        self.max_batch = disable_by_batch_size
        self.min_rate = disable_below_acceptance
        self._counts = weakref.WeakKeyDictionary()  # sequence -> [proposed, accepted]

    def allows(self, seq, num_running: int) -> bool:
        if self.max_batch is not None and num_running > self.max_batch:
            return False
        if self.min_rate > 0.0:
            proposed, accepted = self._counts.get(seq, (0, 0))
            if proposed >= MIN_PROPOSALS and accepted < self.min_rate * proposed:
                return False
        return True

    def record(self, seq, proposed: int, accepted: int):
        if self.min_rate > 0.0:
            counts = self._counts.setdefault(seq, [0, 0])
            counts[0] += proposed
            counts[1] += accepted
