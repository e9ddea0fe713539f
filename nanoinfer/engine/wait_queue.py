"""The scheduler's queue of waiting sequences and the order it serves them in: first in, first out,
preempted sequences back at the front (FifoOrder; the composition place may give another). Any
member is removable in O(1): an aborted request of n samples leaves in O(n), not O(n^2)."""
from collections import OrderedDict
from collections.abc import Iterable, Iterator


class WaitQueue:
    """An ordered set of sequences (by identity)."""
    __slots__ = ("_items",)

    def __init__(self, items: Iterable = ()):
        self._items: OrderedDict = OrderedDict.fromkeys(items)

    def append(self, seq):
        self._items[seq] = None

    def appendleft(self, seq):
        self._items[seq] = None
        self._items.move_to_end(seq, last=False)

    def extendleft_in_order(self, seqs: list):
        """Put `seqs` at the front, keeping their order (the first of them first in line)."""
        for seq in reversed(seqs):
            self.appendleft(seq)

    def popleft(self):
        return self._items.popitem(last=False)[0]

    def discard(self, seq) -> bool:
        """Remove `seq` if it is queued; whether it was."""
        if seq in self._items:
            del self._items[seq]
            return True
        return False

    def __getitem__(self, i: int):
        if i != 0:
            raise IndexError("a WaitQueue gives its first item only")
        return next(iter(self._items))

    def __contains__(self, seq) -> bool:
        return seq in self._items

    def __iter__(self) -> Iterator:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


class FifoOrder:
    """First come, first served. An order makes the waiting queue, places an admitted sequence among
    the running ones (the last is the first preempted), and may act before each step."""

    def queue(self):
        return WaitQueue()

    def place(self, running: list, seq) -> None:
        running.append(seq)

    def start_step(self, scheduler) -> None:
        """A step is about to be scheduled."""

    def priorities(self, priority, num_prompts: int) -> list[int]:
        """Each prompt's `priority` (an int for all, or one per prompt): this order takes only None or 0."""
        values = priority if isinstance(priority, (list, tuple)) else [priority]
        if any(p is not None and p != 0 for p in values):
            raise ValueError("priority is set but this engine serves requests first come, first served")
        return [0] * num_prompts
