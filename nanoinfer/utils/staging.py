"""A step's small host arrays -> device tensors through one staging buffer and one copy.

Each input of a step (token ids, positions, slots, block tables, ...) sent on its own costs a host
allocation, a pinned copy and a launch; packed into one buffer they cost one of each. The buffer is
new every step (the caching host allocator recycles it once its copy has completed), written in
place through a numpy view: on CUDA it is pinned and the copy does not block the host."""
import numpy as np
import torch

_ALIGN = 8  # every part starts at a multiple of the widest element (int64)
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


class Staging:
    def __init__(self):
        self.parts: list[np.ndarray] = []

    def add(self, data, dtype=np.int64) -> int:
        """Queue an array (or a list) to send; returns its index in send()'s list."""
        self.parts.append(np.ascontiguousarray(data, dtype=dtype))
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued part on `device`, in order, with its shape and dtype, after one copy."""
        offsets, total = [], 0
        for a in self.parts:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = buf.numpy()
        for a, off in zip(self.parts, offsets):
            host[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = buf.to(device, non_blocking=True)
        typed = {dt: dev.view(_DTYPES[dt]) for dt in {a.dtype for a in self.parts}}  # (one view per dtype)
        out = []
        for a, off in zip(self.parts, offsets):
            start = off // a.itemsize
            t = typed[a.dtype][start:start + a.size]
            out.append(t if a.ndim == 1 else t.view(a.shape))
        return out
