"""The waiting queue of scheduling_policy="priority": ordered by priority, then arrival (vLLM's
rule), with WaitQueue's interface (engine/wait_queue.py)."""
import heapq
from collections.abc import Iterable, Iterator


def priority_key(seq) -> tuple[int, int, int]:
    """vLLM's priority order: the lower value first, ties by arrival (the request id grows with
    arrival), a request's samples in index order."""
    return seq.priority, seq.request_id, seq.index


class PriorityWaitQueue:
    """WaitQueue's interface, ordered by `priority_key` (a heap). A sequence put back (preempted, or
    a held sample released) takes its place by key, which already ranks it before the later
    arrivals of its priority. Removal is lazy: `discard` forgets the entry in O(1) and the heap
    skips it when it reaches the top; stale entries are compacted away when they outnumber the
    live ones, so the heap stays O(live)."""
    __slots__ = ("_heap", "_live", "_pushes")

    def __init__(self, items: Iterable = ()):
        self._heap: list = []
        self._live: dict = {}  # seq -> its current entry's push number
        self._pushes = 0
        for seq in items:
            self.append(seq)

    def append(self, seq):
        self._pushes += 1
        self._live[seq] = self._pushes
        heapq.heappush(self._heap, (priority_key(seq), self._pushes, seq))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    appendleft = append  # the key decides its place

    def extendleft_in_order(self, seqs: list):
        for seq in seqs:
            self.append(seq)

    def _top(self):
        heap = self._heap
        while heap and self._live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)  # discarded (or superseded by a later push)
        return heap[0][2]

    def popleft(self):
        seq = self._top()
        heapq.heappop(self._heap)
        del self._live[seq]
        return seq

    def discard(self, seq) -> bool:
        return self._live.pop(seq, None) is not None

    def __getitem__(self, i: int):
        if i != 0:
            raise IndexError("a PriorityWaitQueue gives its first item only")
        if not self._live:
            raise IndexError("the queue is empty")
        return self._top()

    def __contains__(self, seq) -> bool:
        return seq in self._live

    def __iter__(self) -> Iterator:
        return iter(sorted(self._live, key=priority_key))

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)
