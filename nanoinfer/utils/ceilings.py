"""The device's measured ceilings, against which the benchmarks state their lower bounds."""
import torch
from triton.testing import do_bench


def measure_ceilings(device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured now."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    bandwidth = 2 * src.numel() * 2 / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = do_bench(lambda: a @ b, return_mode="median")
    return bandwidth, 2 * 8192 ** 3 / (ms * 1e-3)
