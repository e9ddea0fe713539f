"""vLLM's per-request logits processors (SamplingParams.logits_processors), a per-request option
(sampling/option.py): user callables run on the sampling rank's host, row by row, with the row's
token history. A step that runs them samples at once (OptionPayload.eager), so that one that
raises fails that step.
"""
import inspect
import logging
from dataclasses import dataclass

import torch

from nanoinfer.sampling.option import OptionPayload, PlanRows, RankTensors, SamplingOption, Stage

logger = logging.getLogger("nanoinfer")
NAME = "logits_processors"


def _num_params(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return 2


def apply_processors(logits: torch.Tensor, t) -> None:
    """fn(output_ids, row), or fn(prompt_ids, output_ids, row) when it takes three parameters;
    each returns the row to use. One that raises (or returns what does not fit the row) fails its
    own request only: the row is left with no token to sample, which the pipeline marks
    NON_FINITE, and the engine finishes the request with "error"."""
    for row, fns, prompt_ids, output_ids in t.options[NAME]:
        try:
            x = logits[row]
            for fn in fns:
                x = fn(prompt_ids, list(output_ids), x) if _num_params(fn) == 3 else fn(list(output_ids), x)
            logits[row] = x
        except Exception as e:
            logger.warning("a logits processor raised on sampling row %d; its request fails: %s: %s",
                           row, type(e).__name__, e)
            logits[row] = float("-inf")


PROCESSORS = Stage(NAME, lambda t: NAME in t.options, apply_processors, order=10)


@dataclass(slots=True)
class ProcessorRows(OptionPayload):
    """(row, callables, prompt token ids, output token ids) per row that runs them."""
    name, stages = NAME, (PROCESSORS,)
    eager = True

    rows: list[tuple]

    def to_device(self, t, rank: RankTensors) -> None:
        t.options[NAME] = self.rows


class LogitsProcessors(SamplingOption):
    name, stages = NAME, (PROCESSORS,)
    off = {"has_token_constraints": False}  # (SamplingParams' flag: any per-token-id option)

    def uses(self, sp) -> bool:
        return bool(sp.logits_processors)

    def plan(self, rows: list[int], ctx: PlanRows) -> ProcessorRows | None:
        out = []
        for i in rows:
            ctx.check_host_tokens(i)
            if ctx.sampled(i):
                seq = ctx.seqs[i]
                n = seq.num_prompt_tokens
                out.append((i, seq.sampling_params.logits_processors, seq.token_ids[:n], seq.token_ids[n:]))
        return ProcessorRows(out) if out else None
