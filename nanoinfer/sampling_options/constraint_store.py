"""The sampling rank's side of the token constraints (constraint_registry.py): each
request's allowed_token_ids, logit_bias and one-token bad words, kept on the device under a key.

A plan sends a request's TokenConstraints once; every step after names it by key. A step's tensors
are the concatenation of its rows' device tensors, a host cost of one entry per row whatever their
sizes; a decode batch whose rows and keys equal the last step's reuses that step's tensors, as the
column cache does (sampling/column_cache.py). A dropped key frees its tensors.
"""
from dataclasses import dataclass

import torch

from nanoinfer.sampling_options.constraint_registry import TokenConstraints
from nanoinfer.utils.device_copy import to_device

CONSTRAINTS = "token_constraints"  # the option's name: its StepConstraints in SamplingTensors.options


@dataclass(slots=True)
class StepConstraints:
    """A step's constraints (None where no row has one): allowed tokens as (allowed_rows,
    allowed_pos -> index into allowed_rows, allowed_tokens); biases as (bias_rows, bias_tokens,
    bias_values); one-token bad words as (banned_rows, banned_tokens)."""
    allowed_rows: torch.Tensor | None = None
    allowed_pos: torch.Tensor | None = None
    allowed_tokens: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None


@dataclass(slots=True)
class _OnDevice:
    allowed: torch.Tensor | None
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    banned: torch.Tensor | None


def _array_to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if data is None:
        return None
    t = torch.frombuffer(data, dtype=dtype)  # (a view of the message's bytes)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.clone()


class TokenConstraintStore:
    def __init__(self, device: torch.device):
        self.device = device
        self.held: dict[int, _OnDevice] = {}
        self._last: tuple[list, list, StepConstraints] | None = None

    def update(self, new: dict[int, TokenConstraints] | None) -> None:
        """Put a plan's new constraints on the device (a key sent again replaces its tensors)."""
        for key, c in (new or {}).items():
            self.held[key] = _OnDevice(_array_to_device(c.allowed, torch.int64, self.device),
                                       _array_to_device(c.bias_ids, torch.int64, self.device),
                                       _array_to_device(c.bias_values, torch.float32, self.device),
                                       _array_to_device(c.banned, torch.int64, self.device))

    def drop(self, keys: list[int] | None) -> None:
        """Free the tensors of keys no request uses any more (a key not held is ignored)."""
        if not keys:
            return
        for key in keys:
            self.held.pop(key, None)
        if self._last is not None and not set(keys).isdisjoint(self._last[1]):
            self._last = None

    def gather(self, rows: list[int], keys: list[int]) -> StepConstraints:
        """The step's constraint tensors for rows[i] under keys[i]."""
        last = self._last
        if last is not None and last[0] == rows and last[1] == keys:
            return last[2]
        held = [self.held[k] for k in keys]
        out = StepConstraints()
        allowed = [(r, h.allowed) for r, h in zip(rows, held) if h.allowed is not None]
        if allowed:
            out.allowed_rows = to_device([r for r, _ in allowed], torch.int64, self.device)
            out.allowed_pos = self._row_of_entries(list(range(len(allowed))), [t for _, t in allowed])
            out.allowed_tokens = torch.cat([t for _, t in allowed])
        bias = [(r, h) for r, h in zip(rows, held) if h.bias_ids is not None]
        if bias:
            out.bias_rows = self._row_of_entries([r for r, _ in bias], [h.bias_ids for _, h in bias])
            out.bias_tokens = torch.cat([h.bias_ids for _, h in bias])
            out.bias_values = torch.cat([h.bias_values for _, h in bias])
        banned = [(r, h.banned) for r, h in zip(rows, held) if h.banned is not None]
        if banned:
            out.banned_rows = self._row_of_entries([r for r, _ in banned], [t for _, t in banned])
            out.banned_tokens = torch.cat([t for _, t in banned])
        self._last = (list(rows), list(keys), out)
        return out

    def _row_of_entries(self, rows: list[int], parts: list[torch.Tensor]) -> torch.Tensor:
        """rows[i] repeated once per entry of parts[i], on the device (no sync: the size is known)."""
        counts = [t.shape[0] for t in parts]
        return torch.repeat_interleave(to_device(rows, torch.int64, self.device),
                                       to_device(counts, torch.int64, self.device), output_size=sum(counts))
