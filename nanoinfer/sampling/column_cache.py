"""Per-row sampling options kept on the device from one step to the next: a decode batch's columns
(temperature, top-k, ...) change only when a request joins or leaves, so a column equal to the last
step's (one list comparison) reuses its device tensor instead of another copy. The pipeline only reads them."""
import torch

from nanoinfer.utils.device_copy import to_device


class ColumnCache:
    def __init__(self, device: torch.device):
        self.device = device
        self.last: dict[str, tuple[list, torch.dtype, torch.Tensor]] = {}

    def get(self, name: str, data: list, dtype: torch.dtype) -> torch.Tensor:
        """`data` (a flat list) on the device as `dtype`: the last tensor made for `name` if its
        list was equal."""
        hit = self.last.get(name)
        if hit is not None and hit[1] == dtype and hit[0] == data:
            return hit[2]
        t = to_device(data, dtype, self.device)
        self.last[name] = (data, dtype, t)
        return t
