"""Programmatic dependent launch (Hopper and later): a kernel launched this way may start while the
kernel before it in the stream is still running. It calls gdc_wait() before reading anything that
kernel writes (and may load what no kernel writes, such as weights, before), and gdc_launch_dependents()
once it has waited, to let the next such kernel start. Decode at small batch is a chain of short
kernels whose launch gaps are a large part of the step; this overlaps them. NANOINFER_PDL=0 turns it
off (for comparisons)."""
import functools
import os

import torch


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("NANOINFER_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9  # NVIDIA Hopper+


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter."""
    on = device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
