"""Host lists -> device tensors, without waiting for the copy."""
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
