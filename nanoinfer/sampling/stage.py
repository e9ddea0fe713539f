"""The seam of the logits pipeline (sampling/pipeline.py): one entry of its ordered list.

A feature that changes what may be sampled (a grammar bitmask, a speculative verifier) is one more
Stage in that list, next to the code it needs, instead of another branch in the sampler.
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
    the logits alone; the pipeline stops at the first end that applies."""
    name: str
    applies: Callable[[SamplingTensors], bool]
    run: Callable[[torch.Tensor, SamplingTensors], torch.Tensor | None]
    end: bool = False


def run_stages(stages, logits: torch.Tensor, t: SamplingTensors) -> None:
    """The edit stages that apply, in order (an ordered sub-list, such as the sampling end's filters)."""
    for stage in stages:
        if stage.applies(t):
            stage.run(logits, t)
