"""Which devices each data-parallel replica gets."""
import os
from numbers import Integral

import torch


def check_data_parallel_size(value) -> int:
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(f"data_parallel_size must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {value}")
    return int(value)


def replica_envs(data_parallel_size: int, options: dict) -> list[dict[str, str]]:
    """The environment each replica's engine process starts with. On CUDA, replica i gets devices
    i*T .. i*T+T-1 (T: tensor_parallel_size) of those visible (CUDA_VISIBLE_DEVICES' list, else all),
    as its CUDA_VISIBLE_DEVICES, so its ranks 0..T-1 are cuda:0..T-1 there. On CPU: nothing."""
    dp = check_data_parallel_size(data_parallel_size)
    tp = options.get("tensor_parallel_size", 1)
    if not isinstance(tp, Integral) or isinstance(tp, bool) or tp < 1:
        return [{} for _ in range(dp)]  # the engine names the bad value
    if not _uses_cuda(options.get("device", "auto")):
        return [{} for _ in range(dp)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        devices = [str(i) for i in range(torch.cuda.device_count())]
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} CUDA devices; "
                         f"{len(devices)} are visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp:(i + 1) * tp])} for i in range(dp)]


def _uses_cuda(device) -> bool:
    if device == "cuda":
        return True
    if device != "auto":
        return False  # "cpu", or a bad value the engine names
    return torch.cuda.is_available()
