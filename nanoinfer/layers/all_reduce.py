"""Summing partial outputs across tensor-parallel ranks. At decode sizes NCCL's all-reduce is
mostly latency; PyTorch's one-shot all-reduce through symmetric memory (each rank reads its peers'
buffers over NVLink; no multicast) is faster (`python -m nanoinfer.bench.allreduce` times both),
and an 8B decode step does 72 of them. So each layer that all-reduces owns an AllReduce, and on CUDA
`use_symmetric_memory` gives each its own symmetric buffer for inputs of up to `max_rows` rows
and at most BUFFER_BYTES (where one-shot is ahead; it also bounds the memory): its own, so that a
rank running ahead never overwrites a buffer a peer is still reading (the next all-reduce's
barrier is between two uses). Larger inputs (prefill) and CPU use NCCL / gloo.

Where an RMSNorm follows (a row-parallel projection's output, then the residual add and norm), the
projection can write straight into the buffer and hand the norm a PartialSum: layers/fused_norm.py
then runs the all-reduce, residual add and norm as one kernel (kernels/all_reduce_norm.py)."""
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from nanoinfer.kernels.all_reduce_norm import PROGRAMS, all_reduce_norm

logger = logging.getLogger("nanoinfer")

BUFFER_BYTES = 2 << 20  # 256 rows of an 8B model's hidden size in bf16


@dataclass
class Peers:
    """What the fused kernel needs to reach every rank: int64 device tensors of their buffer and
    flag addresses, this rank's barrier counters (kernels/all_reduce_norm.py), and this rank."""
    buffer_ptrs: torch.Tensor
    flag_ptrs: torch.Tensor
    counters: torch.Tensor
    rank: int
    handles: list  # the symmetric-memory handles: the peers' addresses are valid while they live


class AllReduce(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.features = features
        self.buffer: torch.Tensor | None = None  # [max_rows, features], symmetric memory
        self.group_name: str | None = None
        self.peers: Peers | None = None
        # every rank's part gathered, then added in rank order: a row's sum the same bits whatever
        # the number of rows (gloo's and NCCL's rings cut the tensor by its size)
        self.in_rank_order = False

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        n = y.shape[0]
        if self.in_rank_order:
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, y.contiguous())
            total = parts[0]
            for part in parts[1:]:
                total += part
            return total
        if self.buffer is not None and n <= self.buffer.shape[0]:
            self.buffer[:n].copy_(y)
            return torch.ops.symm_mem.one_shot_all_reduce(self.buffer[:n], "sum", self.group_name)
        dist.all_reduce(y)
        return y

    def partial_buffer(self, n: int) -> torch.Tensor | None:
        """Where a projection followed by an RMSNorm writes its [n, features] partial sums (then
        wrapped in a PartialSum), or None: n rows do not fit, or there is no fused kernel here. (The
        fused kernel is ahead of copy + one-shot + norm at every row count: nanoinfer.bench.allreduce.)"""
        if self.peers is None or self.in_rank_order or not 0 < n <= self.buffer.shape[0]:
            return None
        return self.buffer[:n]


@dataclass
class PartialSum:
    """This rank's share of a sum over ranks, in its site's symmetric buffer: for the norm after it
    to reduce, add its residual and normalise in one kernel (layers/fused_norm.py)."""
    value: torch.Tensor   # [n, features], a view of site.buffer
    site: AllReduce

    def reduce_norm(self, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
        peers = self.site.peers
        n, features = self.value.shape
        return all_reduce_norm(peers.buffer_ptrs, peers.flag_ptrs, peers.counters, peers.rank, n, features,
                               self.value.dtype, weight, eps, residual)


def use_symmetric_memory(model: nn.Module, max_rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Give every AllReduce of the model a symmetric buffer (collective: every rank calls it at
    the same point), and the fused all-reduce + norm kernel what it needs. Every rank falls back
    to NCCL if any rank cannot: what can fail on one rank alone (PyTorch too old, no peer access,
    allocation) is tried before any collective and agreed on, so no rank skips a collective that
    a peer waits in. A rendezvous or check reduction that then raises fails the rank loudly."""
    sites = [m for m in model.modules() if isinstance(m, AllReduce)]
    if not sites:
        return False
    world, rank = dist.get_world_size(), dist.get_rank()
    tensors = None
    try:
        import torch.distributed._symmetric_memory as symm_mem  # private PyTorch module: absent from some builds
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
            raise RuntimeError("this PyTorch has no one-shot all-reduce")
        if dtype not in (torch.bfloat16, torch.float32):  # what PyTorch's one-shot all-reduce takes
            raise RuntimeError(f"PyTorch's one-shot all-reduce does not take {dtype}")
        others = [torch.device("cuda", r) for r in range(world) if r != rank]
        if not all(torch.cuda.can_device_access_peer(device, other) for other in others):
            raise RuntimeError("no peer access between the GPUs")
        rows = [max(1, min(max_rows, BUFFER_BYTES // (site.features * dtype.itemsize))) for site in sites]
        tensors = [symm_mem.empty(n * site.features, dtype=dtype, device=device) for n, site in zip(rows, sites)]
        tensors.append(symm_mem.empty(world * PROGRAMS, dtype=torch.int64, device=device).zero_())  # the flags
    except Exception as e:
        logger.info("one-shot all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        tensors = None
    if not _everyone(tensors is not None, device):
        return False
    group = dist.group.WORLD.group_name
    # from here on a failure is not caught: on one rank alone it would leave the others inside a
    # collective, so that rank fails loudly (the engine stops every worker)
    handles = [symm_mem.rendezvous(t, group) for t in tensors]  # (the peers' mappings live with them)
    pointers = []  # every rank's copy of each tensor, at the address this rank sees it
    for t, handle in zip(tensors, handles):
        offset = t.data_ptr() - handle.buffer_ptrs[rank]
        pointers.append(torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device))
    buffers = [t.view(n, site.features) for t, n, site in zip(tensors, rows, sites)]
    probe = buffers[0][:1]
    probe.fill_(rank + 1)
    total = torch.ops.symm_mem.one_shot_all_reduce(probe, "sum", group)
    # (the reduction also orders every rank's zeroed flags before any kernel signals into them)
    if not _everyone(bool(torch.all(total == world * (world + 1) // 2)), device):
        logger.info("one-shot all-reduce gave a wrong sum; using NCCL")
        return False
    counters = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)  # shared: every rank calls in one order
    for site, buf, ptrs in zip(sites, buffers, pointers):
        site.buffer, site.group_name = buf, group
        site.peers = Peers(ptrs, pointers[-1], counters, rank, handles)
    return True


def _everyone(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank (a collective)."""
    flag = torch.tensor([float(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
