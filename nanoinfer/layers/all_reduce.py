"""Summing partial outputs across tensor-parallel ranks. At decode sizes NCCL's all-reduce costs
15-36 us on two H200s, PyTorch's one-shot all-reduce through symmetric memory (each rank reads its
peers' buffers over NVLink; no multicast) 6.5-19 us (`python -m nanoinfer.bench.allreduce`), and
an 8B decode step does 72 of them. So each layer that all-reduces owns an AllReduce, and on CUDA
`use_symmetric_memory` gives each its own symmetric buffer for inputs of up to `max_rows` rows
and at most BUFFER_BYTES (where one-shot was measured ahead; it also bounds the memory): its own,
so that a rank running ahead never overwrites a buffer a peer is still reading (the next
all-reduce's barrier is between two uses). Larger inputs (prefill) and CPU use NCCL / gloo."""
import logging

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("nanoinfer")

BUFFER_BYTES = 2 << 20  # 256 rows of an 8B model's hidden size in bf16


class AllReduce(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.features = features
        self.buffer: torch.Tensor | None = None  # [max_rows, features], symmetric memory
        self.group_name: str | None = None

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        n = y.shape[0]
        if self.buffer is not None and n <= self.buffer.shape[0]:
            self.buffer[:n].copy_(y)
            return torch.ops.symm_mem.one_shot_all_reduce(self.buffer[:n], "sum", self.group_name)
        dist.all_reduce(y)
        return y


def use_symmetric_memory(model: nn.Module, max_rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Give every AllReduce of the model a symmetric buffer (collective: every rank calls it at
    the same point). Checks one reduction first; every rank falls back to NCCL if any rank cannot."""
    sites = [m for m in model.modules() if isinstance(m, AllReduce)]
    ok = torch.ones(1, device=device)
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group = dist.group.WORLD.group_name
        buffers = []
        for site in sites:
            rows = max(1, min(max_rows, BUFFER_BYTES // (site.features * dtype.itemsize)))
            buf = symm_mem.empty(rows * site.features, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group)
            buffers.append(buf.view(rows, site.features))
        probe = buffers[0][:1]
        probe.fill_(dist.get_rank() + 1)
        total = torch.ops.symm_mem.one_shot_all_reduce(probe, "sum", group)
        world = dist.get_world_size()
        ok.fill_(float(torch.all(total == world * (world + 1) // 2)))
    except Exception as e:  # an older PyTorch, no peer access between the GPUs, ...
        logger.info("one-shot all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return False
    for site, buf in zip(sites, buffers):
        site.buffer, site.group_name = buf, group
    return True
