"""The scheduler's queue of waiting sequences: first in, first out, with preempted sequences put
back at the front, and any member removable in O(1) (an aborted request with n samples leaves the
queue in O(n), not O(n^2))."""
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
