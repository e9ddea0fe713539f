"""A step's SamplingPlan as device tensors, on the rank that samples, for the logits pipeline.

A field is None when no row uses it, which is how a pipeline stage knows, on the host, whether it
applies. Each registered option's payload adds its own tensors (`options`, by name) and stages.
"""
from dataclasses import dataclass, field

import torch

from nanoinfer.step.step_message import SamplingPlan
from nanoinfer.sampling.column_cache import ColumnCache
from nanoinfer.sampling.option import RankTensors
from nanoinfer.utils.device_copy import to_device


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor                 # [B] float32; rows < SAMPLING_EPS are greedy
    all_greedy: bool = False
    any_greedy: bool = True
    top_k: torch.Tensor | None = None          # [B] int64, TOP_K_OFF where off
    max_top_k: int = 0                          # largest top_k among rows using it
    top_p: torch.Tensor | None = None          # [B] float32, 1.0 where off
    min_p: torch.Tensor | None = None          # [B] float32, 0.0 where off
    # seeded rows: their noise comes from hash(seed, step, token)
    seeded_rows: torch.Tensor | None = None
    seed_keys: torch.Tensor | None = None      # [S, 2] int64, two 32-bit keys per row
    # logprobs for rows `lp_rows` (None = all rows), top `lp_max` of them
    lp_rows: torch.Tensor | None = None
    lp_rows_list: list[int] | None = None
    lp_counts: list[int] | None = None         # per lp row, its own N
    lp_max: int | None = None
    # a token mask (structured outputs fill it): rows `grammar_rows` keep the tokens their
    # [G, ceil(V / 32)] int32 bitmask allows; the bitmask may come after the forward's launch
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    options: dict = field(default_factory=dict)  # the registered options' tensors, by option name
    stages: tuple = ()                          # their Stages, in pipeline order (sampling/pipeline.py)
    plain: bool = False                        # SamplingPlan.fused: temperature alone, after any token mask
    seed: int | None = None                    # SamplingPlan.seed

    @classmethod
    def from_plan(cls, plan: SamplingPlan, device: torch.device, prev_tokens=None,
                  columns: ColumnCache | None = None, states: dict | None = None) -> "SamplingTensors":
        """`prev_tokens`: the tokens of the step in flight, which the options may read. `columns`,
        `states`: the sampler's ColumnCache and options' state (RankTensors; None: new ones, for a
        plan that sends all it names)."""
        p, columns = plan, ColumnCache(device) if columns is None else columns
        t = cls(columns.get("temperatures", p.temperatures, torch.float32), all_greedy=p.all_greedy,
                any_greedy=p.any_greedy, plain=p.fused, seed=p.seed)
        if p.top_k is not None:
            t.top_k, t.max_top_k = columns.get("top_k", p.top_k, torch.int64), p.max_top_k
        if p.top_p is not None:
            t.top_p = columns.get("top_p", p.top_p, torch.float32)
        if p.min_p is not None:
            t.min_p = columns.get("min_p", p.min_p, torch.float32)
        if p.seeded_rows:
            t.seeded_rows = to_device(p.seeded_rows, torch.int64, device)
            t.seed_keys = to_device(p.seed_keys, torch.int64, device)
        if p.lp_counts:
            t.lp_rows = None if p.lp_rows is None else to_device(p.lp_rows, torch.int64, device)
            t.lp_rows_list = list(range(len(p.temperatures))) if p.lp_rows is None else p.lp_rows
            t.lp_counts, t.lp_max = p.lp_counts, p.lp_max
        if p.options:
            rank = RankTensors(device, columns, states, prev_tokens)
            for payload in p.options:
                payload.to_device(t, rank)
            stages = dict.fromkeys(s for payload in p.options if payload.edits for s in payload.stages)
            t.stages = tuple(sorted(stages, key=lambda s: s.order))
        return t

    def set_grammar_bitmask(self, bitmask: torch.Tensor, device: torch.device) -> None:
        """The token mask's [G, W] int32 bitmask, from a host tensor (pinned on CUDA: the copy does
        not block; its memory is not rewritten before the step has been collected)."""
        self.grammar_bitmask = bitmask.to(device, non_blocking=True) if device.type == "cuda" else bitmask
