"""The per-step message rank 0 sends tensor-parallel workers: only what ModelRunner.prepare_prefill /
prepare_decode read. A prefill carries its scheduled token ids (all of them, also on a re-prefill
after preemption), a decode only the last token; both carry lengths and block tables."""
from nanoinfer.engine.sequence import Sequence


def encode_step(seqs: list[Sequence], is_prefill: bool) -> tuple:
    if is_prefill:
        return True, [(s.num_computed_tokens, s.token_ids[s.num_computed_tokens:s.num_computed_tokens
                                                           + s.num_scheduled_tokens], s.block_table) for s in seqs]
    return False, [(s.last_token, len(s), s.block_table) for s in seqs]


class _TokenWindow:
    """token_ids[start:start + len(ids)] of a sequence, sliced with the sequence's own positions."""
    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1) or (key.start or 0) < self.start:
            raise IndexError(f"a worker holds only tokens {self.start}..{self.start + len(self.ids)} "
                             f"of this step, not {key}")
        stop = None if key.stop is None else key.stop - self.start
        return self.ids[(key.start or 0) - self.start:stop]


class StepSequence:
    """The fields of a Sequence that ModelRunner.prepare_prefill / prepare_decode read, on a worker."""
    __slots__ = ("token_ids", "last_token", "num_computed_tokens", "num_scheduled_tokens", "block_table", "_len")

    def __len__(self):
        return self._len


def decode_step(is_prefill: bool, rows: list) -> tuple[list[StepSequence], bool]:
    seqs = []
    for row in rows:
        s = StepSequence()
        if is_prefill:
            start, ids, s.block_table = row
            s.token_ids, s.num_computed_tokens, s.num_scheduled_tokens = _TokenWindow(start, ids), start, len(ids)
            s.last_token, s._len = ids[-1], start + len(ids)
        else:
            s.last_token, s._len, s.block_table = row
            s.token_ids, s.num_computed_tokens, s.num_scheduled_tokens = None, s._len - 1, 1
        seqs.append(s)
    return seqs, is_prefill
