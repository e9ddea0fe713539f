"""The policy that turns speculation off (nanoinfer/speculative/policy.py)."""
from nanoinfer.speculative.policy import MIN_PROPOSALS, SpeculationPolicy


class Seq:
    pass


def test_batch_size_threshold():
    p = SpeculationPolicy(4, 0.0)
    assert p.allows(Seq(), 4) and not p.allows(Seq(), 5)
    assert SpeculationPolicy(None, 0.0).allows(Seq(), 10**6)


def test_low_acceptance_turns_a_sequence_off_once_judged():
    p = SpeculationPolicy(None, 0.5)
    bad, good = Seq(), Seq()
    for _ in range(MIN_PROPOSALS // 4 - 1):
        p.record(bad, 4, 1)
        p.record(good, 4, 3)
    assert p.allows(bad, 1) and p.allows(good, 1)  # not judged yet
    p.record(bad, 4, 1)
    p.record(good, 4, 3)
    assert not p.allows(bad, 1) and p.allows(good, 1)
    off = SpeculationPolicy(None, 0.0)  # 0: never judged
    off.record(bad, 100, 0)
    assert off.allows(bad, 1)
