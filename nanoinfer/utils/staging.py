"""A step's small host arrays -> device tensors through one staging buffer and one copy.

Each input of a step (token ids, positions, slots, block tables, ...) sent on its own costs a host
tensor, a pinned copy and a launch; packed into one buffer they cost one of each. Lists are packed
by the array module, numpy arrays by their bytes. On CUDA the bytes are written into a pinned
buffer kept for the purpose (_PinnedBuffers) and the copy does not block the host: pinning a fresh
buffer every step cost the host more than the rest of the staging."""
import math
from array import array

import numpy as np
import torch

_ALIGN = 16  # every part starts 16-byte aligned, as its own allocation would (Triton specialises on it)
_CODES = {np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.float32): "f"}
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


class Staging:
    def __init__(self):
        self.buffer = bytearray()
        self.parts: list[tuple[np.dtype, int, tuple[int, ...]]] = []  # (dtype, first element, shape)

    def add(self, data, dtype=np.int64) -> int:
        """Queue a flat list (or sequence) or a numpy array to send as `dtype`; returns its index in
        send()'s list."""
        dt = np.dtype(dtype)
        self.buffer.extend(bytes(-len(self.buffer) % _ALIGN))
        start = len(self.buffer) // dt.itemsize
        if isinstance(data, np.ndarray):
            self.buffer.extend(np.ascontiguousarray(data, dtype=dt).tobytes())
            shape = data.shape
        else:  # a list (or any sequence) of Python numbers
            self.buffer.extend(array(_CODES[dt], data))
            shape = (len(data),)
        self.parts.append((dt, start, shape))
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued part on `device`, in order, with its shape and dtype, after one copy."""
        # (whole aligned words for the typed views; torch.frombuffer takes no empty buffer)
        self.buffer.extend(bytes(-len(self.buffer) % _ALIGN if self.buffer else _ALIGN))
        if device.type == "cuda":
            dev = _pinned_buffers(device).send(self.buffer, device)
        else:
            dev = torch.frombuffer(self.buffer, dtype=torch.uint8)  # (shares the bytearray's memory)
        views = {dt: dev.view(_DTYPES[dt]) for dt in {dt for dt, _, _ in self.parts}}
        out = []
        for dt, start, shape in self.parts:
            t = views[dt][start:start + math.prod(shape)]
            out.append(t if len(shape) == 1 else t.view(shape))
        return out


class _PinnedBuffers:
    """A device's pinned host buffers, used in turn: a step's bytes are written into the next one
    in place and copied out without waiting. A buffer is written again only once the copy out of
    it has run (an event recorded behind the copy); with several in turn, that wait is all but
    never one. A buffer too small for a step is replaced by a larger one (the caching host
    allocator keeps the old one until its copy has run)."""
    COUNT = 4

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None] * self.COUNT
        self.views: list[np.ndarray | None] = [None] * self.COUNT  # each buffer's bytes, writable from numpy
        self.events: list[torch.cuda.Event | None] = [None] * self.COUNT
        self.turn = 0

    def send(self, data: bytearray, device: torch.device) -> torch.Tensor:
        """data on `device` as uint8, enqueued on the current stream."""
        i, n = self.turn, len(data)
        self.turn = (i + 1) % self.COUNT
        if self.buffers[i] is None or self.buffers[i].numel() < n:
            self.buffers[i] = torch.empty(max(4096, 1 << (n - 1).bit_length()), dtype=torch.uint8, pin_memory=True)
            self.views[i] = self.buffers[i].numpy()
        elif self.events[i] is not None:
            self.events[i].synchronize()
        self.views[i][:n] = np.frombuffer(data, np.uint8)
        dev = self.buffers[i][:n].to(device, non_blocking=True)
        if self.events[i] is None:
            self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return dev


_PINNED: dict[int, _PinnedBuffers] = {}


def _pinned_buffers(device: torch.device) -> _PinnedBuffers:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PINNED:
        _PINNED[index] = _PinnedBuffers()
    return _PINNED[index]
