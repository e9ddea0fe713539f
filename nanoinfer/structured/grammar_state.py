"""One sequence's place in its grammar: an xgrammar GrammarMatcher and how many of the sequence's
completion tokens it has consumed.

Each of a request's n samples has its own (set on its Sequence at intake, as `seq.grammar`), so it
lives exactly as long as the sequence: a finished or aborted sequence that the engine drops takes
its matcher with it. It advances lazily, when its next token's bitmask is filled: by the engine
once the step is launched up to its logits and the step before it has been processed
(structured/step_masks.py), so the host has every earlier token; with tensor parallelism, when
the sampling plan is built (sampling_options/grammar.py), the scheduler running a structured request only
with no token in flight. It is fed the tokens it has not seen. Preemption (recompute) keeps the
tokens, so it keeps the state.
"""
import logging

import numpy as np
import torch

from nanoinfer.structured.xgrammar_import import import_xgrammar

logger = logging.getLogger("nanoinfer")


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: bit j of word i allows token 32 * i + j."""
    return (vocab_size + 31) // 32


class GrammarState:
    __slots__ = ("matcher", "consumed", "stop_token_ids", "broken", "__weakref__")

    def __init__(self, compiled_grammar, stop_token_ids):

        self.matcher = import_xgrammar().GrammarMatcher(compiled_grammar)
        self.consumed = 0              # completion tokens accepted so far
        self.stop_token_ids = list(stop_token_ids)
        self.broken = False            # the matcher refused a token: from then on only a stop token

    @property
    def finished(self) -> bool:
        """The grammar took a stop token (or broke): only stop tokens remain."""
        return self.broken or self.matcher.is_terminated()

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Feed the completion tokens (of the sequence's `token_ids`) not consumed yet. A token after
        the grammar finished (ignore_eos keeps going on stop tokens) is skipped; one the grammar
        refuses (the mask left the sampler nothing, e.g. min_tokens suppressing the only stop token)
        breaks the state."""
        for tok in token_ids[num_prompt_tokens + self.consumed:]:  # (only the new tokens are copied)
            self.consumed += 1
            if self.finished:
                continue
            if not self.matcher.accept_token(tok):
                self.broken = True
                logger.warning("structured outputs: the grammar refused token %d; only stop tokens are "
                               "allowed from here", tok)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next token's allowed set into `bitmask[row]` (a CPU int32 tensor of words)."""
        if self.finished:
            words = bitmask.numpy().view(np.uint32)  # (the same memory)
            words[row] = 0
            for t in self.stop_token_ids:
                words[row, t >> 5] |= np.uint32(1 << (t & 31))
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


BATCH_FILL_MIN_ROWS = 8  # from this many live matchers on, xgrammar fills their masks on several threads
_batch_matcher = None


def fill_bitmasks(seqs: list, vocab_size: int) -> bytes:
    """Advance each sequence's grammar over its new completion tokens, then fill its next token's
    bitmask: one [len(seqs), bitmask_width] int32 block, as bytes (for the step message)."""
    bitmask = torch.empty((len(seqs), bitmask_width(vocab_size)), dtype=torch.int32)
    fill_bitmask_rows(seqs, bitmask)
    return bitmask.numpy().tobytes()


def fill_bitmask_rows(seqs: list, bitmask: torch.Tensor) -> None:
    """fill_bitmasks into rows 0 .. len(seqs) - 1 of `bitmask` (a CPU int32 tensor, maybe pinned):
    the live matchers' masks filled in one batched call (on several threads from
    BATCH_FILL_MIN_ROWS on)."""
    live, rows = [], []
    for j, seq in enumerate(seqs):
        state = seq.grammar
        state.advance(seq.token_ids, seq.num_prompt_tokens)
        if state.finished:
            state.fill(bitmask, j)
        else:
            live.append(state.matcher)
            rows.append(j)
    batch = _batch_fill() if len(live) >= BATCH_FILL_MIN_ROWS else None
    if batch is not None:
        batch.batch_fill_next_token_bitmask(live, bitmask, rows)
    else:
        for matcher, j in zip(live, rows):
            matcher.fill_next_token_bitmask(bitmask, j)


def _batch_fill():
    """xgrammar's multi-threaded BatchGrammarMatcher (None in versions without it)."""
    global _batch_matcher
    if _batch_matcher is None:

        cls = getattr(import_xgrammar(), "BatchGrammarMatcher", None)
        _batch_matcher = False if cls is None else cls()
    return _batch_matcher or None
