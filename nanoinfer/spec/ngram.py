"""Prompt lookup (n-gram) proposals: find the sequence's last n tokens earlier in its own tokens
(prompt and output, n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that
followed the latest such occurrence. Vectorised with numpy: one comparison of every window per n."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoinfer.speculative.proposer import Proposer


def lookup(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the
    largest n in [n_min, n_max] that occurs; [] if none does."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        windows = sliding_window_view(tokens[:L - 1], n)  # starts 0 .. L - 1 - n: each followed by a token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int):
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, seqs: list, max_lens: list[int]) -> list[list[int]]:
        return [lookup(np.asarray(seq.token_ids, dtype=np.int64), self.n_max, self.n_min, k)
                for seq, k in zip(seqs, max_lens)]
