"""A step's small host arrays -> device tensors through one staging buffer and one copy.

Each input of a step (token ids, positions, slots, block tables, ...) sent on its own costs a host
tensor, a pinned copy and a launch; packed into one buffer they cost one of each. Lists are packed
by the array module, numpy arrays by their bytes; on CUDA the buffer is pinned and the copy does
not block the host."""
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
        buf = torch.frombuffer(self.buffer, dtype=torch.uint8)  # (shares the bytearray's memory)
        if device.type == "cuda":
            buf = buf.pin_memory()
        dev = buf.to(device, non_blocking=True)
        views = {dt: dev.view(_DTYPES[dt]) for dt in {dt for dt, _, _ in self.parts}}
        out = []
        for dt, start, shape in self.parts:
            t = views[dt][start:start + math.prod(shape)]
            out.append(t if len(shape) == 1 else t.view(shape))
        return out
