"""The waiting queues: FCFS with put-backs at the front, and the priority heap (vLLM's order: the
lower value first, ties by arrival) with O(1) removal."""
from hypothesis import given, settings, strategies as st

from nanoinfer.engine.wait_queue import WaitQueue
from nanoinfer.priority.wait_queue import PriorityWaitQueue, priority_key


class Seq:
    def __init__(self, request_id, priority, index=0):
        self.request_id, self.priority, self.index = request_id, priority, index

    def __repr__(self):
        return f"Seq({self.request_id}, p={self.priority}, i={self.index})"


def test_fcfs_queue_order_and_front():
    a, b, c = Seq(0, 0), Seq(1, 0), Seq(2, 0)
    q = WaitQueue([a, b])
    q.appendleft(c)
    assert list(q) == [c, a, b] and q[0] is c
    assert q.discard(a) and not q.discard(a)
    assert [q.popleft(), q.popleft()] == [c, b] and not q


def test_priority_queue_orders_by_priority_then_arrival():
    seqs = [Seq(0, 2), Seq(1, 0), Seq(2, 1), Seq(3, 0), Seq(4, 2, index=1), Seq(4, 2, index=0)]
    q = PriorityWaitQueue(seqs)
    out = [q.popleft() for _ in range(len(seqs))]
    assert [(s.priority, s.request_id, s.index) for s in out] == \
        [(0, 1, 0), (0, 3, 0), (1, 2, 0), (2, 0, 0), (2, 4, 0), (2, 4, 1)]


def test_priority_queue_put_back_takes_its_place():
    """A preempted sequence goes back by its key: before the later arrivals of its priority, after
    the better priorities."""
    old, high, late = Seq(0, 1), Seq(5, 0), Seq(9, 1)
    q = PriorityWaitQueue([late, high])
    q.appendleft(old)
    assert list(q) == [high, old, late] and q[0] is high


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "pop", "discard"]), st.integers(0, 5), st.integers(0, 40)),
                    max_size=120))
def test_priority_queue_matches_a_sorted_list(ops):
    """Random adds, pops and discards (re-adds included): always the sorted reference's order,
    and the heap stays bounded by the live entries."""
    q, ref, made = PriorityWaitQueue(), [], []
    for op, prio, pick in ops:
        if op == "add":
            seq = made[pick % len(made)] if made and pick % 3 == 0 else Seq(len(made), prio)  # re-add or new
            if seq not in made:
                made.append(seq)
            if seq not in ref:
                ref.append(seq)
                q.append(seq)
        elif op == "pop" and ref:
            want = min(ref, key=priority_key)
            assert q[0] is want and q.popleft() is want
            ref.remove(want)
        elif op == "discard" and made:
            seq = made[pick % len(made)]
            assert q.discard(seq) == (seq in ref)
            if seq in ref:
                ref.remove(seq)
        assert len(q) == len(ref) and bool(q) == bool(ref)
        assert list(q) == sorted(ref, key=priority_key)
        assert len(q._heap) <= 2 * len(ref) + 65
