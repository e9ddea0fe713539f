"""Host lists and tensors -> device tensors, without waiting for the copy.

A CUDA copy from pageable host memory first waits for the stream's queued work, so one such copy
while the previous step runs stalls the host for the rest of that step. Copies go through
pinned memory instead (the caching host allocator keeps it until the copy has run)."""
from array import array

import torch

_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}  # array typecodes (8 and 4 bytes on our platforms)
_ARRAY_MIN_LEN = 1024  # longer flat lists go through a C array, which torch reads far faster than a list


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A copy of `data` (a flat or nested list) on `device`, enqueued: on CUDA from pinned memory,
    so the host does not wait for it."""
    pin = device.type == "cuda"
    code = _ARRAY_CODES.get(dtype)
    if code and len(data) > _ARRAY_MIN_LEN and not isinstance(data[0], list):
        t = torch.frombuffer(array(code, data), dtype=dtype)
        t = t.pin_memory() if pin else t.clone()
    else:
        t = torch.tensor(data, dtype=dtype, pin_memory=pin)
    return t.to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, enqueued (through pinned memory on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
