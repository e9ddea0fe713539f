"""Per-device arrival counters for kernels whose last-arriving program finishes the work of the
others (the few-row GEMM's split-K, the decode attention's split merge).

A counter is zero between calls: the program that finishes resets its own. Calls on one stream
run one after another, so one buffer per device serves every call. It grows when a call needs
more counters; an outgrown buffer is kept, since a CUDA graph captured earlier still points at it.
"""
import torch

_MIN_COUNTERS = 4096


class ArrivalCounters:
    def __init__(self):
        self.counts: dict[torch.device, torch.Tensor] = {}
        self.outgrown: list[torch.Tensor] = []

    def fits(self, device: torch.device, n: int) -> bool:
        """Whether `device` already has at least n counters (get() would allocate nothing)."""
        counts = self.counts.get(device)
        return counts is not None and counts.numel() >= n

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """At least n zeroed int32 counters on `device`."""
        if not self.fits(device, n):
            if device in self.counts:
                self.outgrown.append(self.counts[device])
            self.counts[device] = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        return self.counts[device]
