"""Per-row sampling options kept on the device from one step to the next.

A decode batch's rows, and so its temperature, top-k, top-p, min-p and penalty columns, change only
when a request joins or leaves; a column equal to the previous step's (one list comparison) reuses
that step's device tensor instead of another host tensor and copy. The pipeline only reads them."""
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
