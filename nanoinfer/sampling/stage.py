"""The seam of the logits pipeline (sampling/pipeline.py): one entry of its ordered list.

A feature that changes what may be sampled (a grammar bitmask, a penalty) is one more Stage, next
to the code it needs (its option's payload names it: sampling/option.py), instead of another branch
in the sampler.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoinfer.sampling.tensors import SamplingTensors


@dataclass(frozen=True, slots=True)
class Stage:
    """`applies(t)`: whether this step's rows use the stage, read from SamplingTensors' host-side
    fields (None where no row uses a feature), so that deciding costs no device sync.
    `run(logits, t)`: edits the [B, V] float32 logits in place, only the rows that use it.
    An end (`end=True`) picks the tokens instead: `run` returns them, [B] on the device, and leaves
    the logits alone; the pipeline stops at the first end that applies. `order`: its place in
    vLLM's order, among the stages of a step's options."""
    name: str
    applies: Callable[[SamplingTensors], bool]
    run: Callable[[torch.Tensor, SamplingTensors], torch.Tensor | None]
    end: bool = False
    order: int = 0

