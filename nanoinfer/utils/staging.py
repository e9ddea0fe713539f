"""A step's small host arrays -> device tensors through one staging buffer and one copy.

Each input of a step (token ids, positions, slots, block tables, ...) sent on its own costs a host
allocation, a pinned copy and a launch; packed into one buffer they cost one of each. The buffer is
new every step (the caching host allocator recycles it once its copy has completed), written in
place through numpy views: on CUDA it is pinned and the copy does not block the host."""
import math

import numpy as np
import torch

_ALIGN = 8  # every part starts at a multiple of the widest element (int64)
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


class Staging:
    def __init__(self):
        self.parts: list[tuple[object, np.dtype, tuple[int, ...]]] = []

    def add(self, data, dtype=np.int64) -> int:
        """Queue a flat list or a numpy array to send as `dtype`; returns its index in send()'s list."""
        shape = (len(data),) if isinstance(data, list) else data.shape
        self.parts.append((data, np.dtype(dtype), shape))
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued part on `device`, in order, with its shape and dtype, after one copy."""
        places, total = [], 0
        for _, dt, shape in self.parts:
            size = math.prod(shape)
            places.append((total // dt.itemsize, size))
            total += -(-size * dt.itemsize // _ALIGN) * _ALIGN
        buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = buf.numpy()
        dtypes = {dt for _, dt, _ in self.parts}
        host_views = {dt: host.view(dt) for dt in dtypes}
        for (data, dt, _), (start, size) in zip(self.parts, places):  # (numpy converts lists and casts here)
            host_views[dt][start:start + size] = data if isinstance(data, list) else data.reshape(-1)
        dev = buf.to(device, non_blocking=True)
        dev_views = {dt: dev.view(_DTYPES[dt]) for dt in dtypes}
        out = []
        for (_, dt, shape), (start, size) in zip(self.parts, places):
            t = dev_views[dt][start:start + size]
            out.append(t if len(shape) == 1 else t.view(shape))
        return out
