"""Which experts a rank holds, and the tokens routed to each rank's experts.

Rank r of N holds experts [r * E / N, (r + 1) * E / N), whole (every intermediate feature). Hidden
states are replicated on every rank after attention's all-reduce, and so is the routing (the router
is replicated), so no token moves: each rank runs only the (token, expert) pairs routed to its own
experts (the others get expert id -1, which the expert kernels skip) and the MoE's existing
all-reduce sums the ranks' partial outputs. Shapes never depend on the routing: no host sync, no
compaction, safe inside CUDA graphs."""
import torch
from torch import nn

from nanoinfer.utils.context import get_context

LOAD_COUNTER = "expert_parallel_rank_tokens"  # the counter's name in ModelRunner.info()["counters"]


class ExpertPlacement:
    def __init__(self, rank: int, size: int, num_experts: int):
        if num_experts % size:
            raise ValueError(f"expert_parallel_size={size} must divide the model's {num_experts} experts")
        self.rank, self.size, self.num_experts = rank, size, num_experts
        self.per_rank = num_experts // size
        self.first = rank * self.per_rank

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.per_rank

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids [M, top_k] -> this rank's local ids, -1 where another rank holds the expert."""
        local = ids - self.first
        return torch.where((local >= 0) & (local < self.per_rank), local, torch.full_like(local, -1))


class ExpertLoad(nn.Module):
    """Tokens routed to each rank's experts, summed over steps (and over the layers, as the runner
    adds counters of the same name). Kept on the device: counting costs no host sync, and the host
    reads it only when statistics are read. Rows written nowhere (slot -1: a CUDA graph's padding)
    and forwards without slots (the memory-profiling forward) are not counted."""

    def __init__(self, placement: ExpertPlacement):
        super().__init__()
        self.per_rank = placement.per_rank
        self.tokens = torch.zeros(placement.size, dtype=torch.int64)  # (a plain tensor: not a weight)

    def count(self, ids: torch.Tensor):
        slots = get_context().slot_mapping
        if slots is None or slots.shape[0] != ids.shape[0]:
            return
        owners = (ids // self.per_rank).reshape(-1).to(torch.int64)
        real = (slots >= 0).to(torch.int64)[:, None].expand(ids.shape).reshape(-1)
        self.tokens.index_add_(0, owners, real)

    def read_counters(self) -> dict[str, torch.Tensor]:
        return {LOAD_COUNTER: self.tokens}
