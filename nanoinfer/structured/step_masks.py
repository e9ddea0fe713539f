"""A step's grammar bitmasks, filled while the device runs the step's forward (vLLM's order).

With overlapped steps, a structured row of step N+1 needs step N's token before its mask, and that
token reaches the host only after step N+1 is launched. So the engine launches step N+1's forward
without the masks (the runner stops at the logits), processes step N (its tokens join their
sequences), and only then fills the masks of step N+1's structured rows. Step N+1 samples when the
engine next needs it: just before step N+2's forward, once step N+2 is scheduled and encoded, or
when its results are collected. The host's mask work, and the next step's scheduling, overlap the
forward; a structured request runs every step, as the others do. A step that runs user logits
processors samples as soon as its masks are in, so that an error in them fails that step.

The masks go into one reused int32 buffer, pinned on CUDA, so that their copy to the device does
not block: it is rewritten only for the next step's masks, after the engine has collected this
step (which waits for the copy).
"""
import torch

from nanoinfer.structured.grammar_state import bitmask_width, fill_bitmask_rows


class AwaitingMasks:
    """A launched step's sampling, waiting for its grammar rows' masks: their sequences until the
    masks are filled, then the masks until it samples."""
    __slots__ = ("seqs", "bitmask", "eager")

    def __init__(self, seqs: list, eager: bool):
        self.seqs = seqs
        self.bitmask: torch.Tensor | None = None
        self.eager = eager  # it runs user logits processors: sample once the masks are in


class StepMasks:
    def __init__(self, vocab_size: int, pin_memory: bool):
        self.width = bitmask_width(vocab_size)
        self.pin_memory = pin_memory
        self.buffer: torch.Tensor | None = None

    def fill(self, awaiting: AwaitingMasks) -> None:
        """Advance each sequence's grammar over its new tokens and fill its next token's mask (once)."""
        if awaiting.seqs is None:
            return
        g = len(awaiting.seqs)
        if self.buffer is None or self.buffer.shape[0] < g:
            rows = max(g, 2 * self.buffer.shape[0] if self.buffer is not None else 16)
            self.buffer = torch.empty((rows, self.width), dtype=torch.int32, pin_memory=self.pin_memory)
        fill_bitmask_rows(awaiting.seqs, self.buffer[:g])
        awaiting.bitmask, awaiting.seqs = self.buffer[:g], None

    def sample(self, runner, handle, awaiting: AwaitingMasks) -> None:
        """The step's sampling under its masks (filled now if they were not)."""
        self.fill(awaiting)
        runner.sample_launched(handle, awaiting.bitmask)
