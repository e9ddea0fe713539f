"""Prompt lookup: the tokens after the latest earlier occurrence of the longest suffix n-gram."""
import numpy as np

from nanoinfer.speculative.ngram import NgramProposer, lookup


def arr(x):
    return np.asarray(x, dtype=np.int64)


def test_longest_suffix_wins_and_latest_occurrence():
    # suffix [1, 2, 3]: occurs at 0 (followed by 7 8) ; suffix [2, 3] also at 5 (followed by 9)
    tokens = arr([1, 2, 3, 7, 8, 2, 3, 9, 1, 2, 3])
    assert lookup(tokens, 3, 1, 2) == [7, 8]
    assert lookup(tokens, 2, 1, 2) == [9, 1]  # n = 2: the latest [2, 3] is at 5
    assert lookup(tokens, 3, 1, 5) == [7, 8, 2, 3, 9]


def test_no_match_below_min_and_short_sequences():
    assert lookup(arr([1, 2, 3, 4]), 3, 1, 3) == []
    assert lookup(arr([5, 6, 5, 7]), 2, 2, 3) == []  # only the 1-gram [7]... and not even that
    assert lookup(arr([5, 6, 5]), 2, 1, 3) == [6, 5]
    assert lookup(arr([4]), 3, 1, 3) == []


def test_proposer_caps_each_sequence():
    class Seq:
        def __init__(self, t):
            self.token_ids = t

    p = NgramProposer(2, 1)
    assert p.propose([Seq([1, 2, 3, 1, 2]), Seq([9, 8])], [1, 3]) == [[3], []]
