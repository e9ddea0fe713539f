"""A step's sampling options as device tensors, for the logits pipeline (sampling/pipeline.py).

The engine builds a SamplingPlan (plain lists, one Python loop over the batch: sampling/plan.py);
the rank that samples turns it into these: [B]-sized temperatures and filters, and, only for the rows
that use them, penalty histories, suppressed tokens (min_tokens, bad words), allowed tokens, logit
biases (allowed ids, biases and one-token bad words kept on the device per request:
sampling/constraint_store.py), grammar bitmasks (structured outputs), seeds, logprob requests and
logits processors. A field is None when no row uses it, which is how a pipeline stage knows, on the host, whether it
applies. Vocabulary-sized work happens only on the device.
"""
from dataclasses import dataclass, field

import torch

from nanoinfer.step.step_message import SamplingPlan
from nanoinfer.sampling.column_cache import ColumnCache
from nanoinfer.sampling.constraint_store import StepConstraints, TokenConstraintStore
from nanoinfer.sampling.plan import build_sampling_plan
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
    # penalties, for rows `pen_rows` (None = all rows)
    pen_rows: torch.Tensor | None = None
    pen_tokens: torch.Tensor | None = None     # [P, L] int64 prompt+output token ids, padded with -1
    pen_prompt_lens: torch.Tensor | None = None  # [P] int64
    presence: torch.Tensor | None = None       # [P] float32
    frequency: torch.Tensor | None = None      # [P]
    repetition: torch.Tensor | None = None     # [P]
    # min_tokens and bad words: logits[suppress_rows, suppress_tokens] = -inf
    suppress_rows: torch.Tensor | None = None
    suppress_tokens: torch.Tensor | None = None
    # seeded rows: their noise comes from hash(seed, step, token)
    seeded_rows: torch.Tensor | None = None
    seed_keys: torch.Tensor | None = None      # [S, 2] int64, two 32-bit keys per row
    # logprobs for rows `lp_rows` (None = all rows), top `lp_max` of them
    lp_rows: torch.Tensor | None = None
    lp_rows_list: list[int] | None = None
    lp_counts: list[int] | None = None         # per lp row, its own N
    lp_max: int | None = None
    # the requests' allowed_token_ids, logit_bias and one-token bad words, gathered from the device
    # (sampling/constraint_store.py)
    constraints: StepConstraints = field(default_factory=StepConstraints)
    # structured outputs: rows `grammar_rows` keep the tokens their [G, ceil(V / 32)] int32 bitmask allows
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # logits_processors: (row, callables, prompt token ids, output token ids), run on the host
    processors: list | None = None
    plain: bool = False                        # SamplingPlan.fused: temperature alone, after any grammar bitmask
    seed: int | None = None                    # SamplingPlan.seed

    @classmethod
    def build(cls, seqs, vocab_size: int, eos_token_ids, device: torch.device) -> "SamplingTensors":
        """build_sampling_plan, then from_plan, for a batch with no step in flight (tests, benchmarks)."""
        return cls.from_plan(build_sampling_plan(seqs, vocab_size, eos_token_ids), device)

    @classmethod
    def from_plan(cls, plan: SamplingPlan, device: torch.device, prev_tokens=None,
                  columns: ColumnCache | None = None,
                  constraints: TokenConstraintStore | None = None) -> "SamplingTensors":
        """The plan's lists as device tensors (rank 0). `prev_tokens`: the tokens of the step in
        flight, on the device, which the plan's late penalty entries read. `columns`: where the
        per-row option columns of the last step are kept (the runner's; None: made anew).
        `constraints`: the requests' token constraints on the device (the runner's; None: a new
        store, for a plan that sends all it names)."""
        pin = device.type == "cuda"

        def dev(data, dtype):
            return to_device(data, dtype, device)

        def column(name, data, dtype):  # (per-row options: usually the same as the last step's)
            return columns.get(name, data, dtype) if columns is not None else dev(data, dtype)

        p = plan
        t = cls(column("temperatures", p.temperatures, torch.float32), all_greedy=p.all_greedy,
                any_greedy=p.any_greedy, plain=p.fused, seed=p.seed)
        if p.top_k is not None:
            t.top_k, t.max_top_k = column("top_k", p.top_k, torch.int64), p.max_top_k
        if p.top_p is not None:
            t.top_p = column("top_p", p.top_p, torch.float32)
        if p.min_p is not None:
            t.min_p = column("min_p", p.min_p, torch.float32)
        if p.seeded_rows:
            t.seeded_rows, t.seed_keys = dev(p.seeded_rows, torch.int64), dev(p.seed_keys, torch.int64)
        if p.pen_tokens is not None:
            padded = torch.frombuffer(p.pen_tokens, dtype=torch.int64).view(len(p.pen_prompt_lens), -1)
            t.pen_rows = None if p.pen_rows is None else dev(p.pen_rows, torch.int64)
            t.pen_tokens = padded.pin_memory().to(device, non_blocking=True) if pin else padded.clone()
            if p.pen_late:  # a row's token still in flight goes after its host tokens
                r, c, src = (dev(list(x), torch.int64) for x in zip(*p.pen_late))
                t.pen_tokens[r, c] = prev_tokens.index_select(0, src).to(torch.int64)
            t.pen_prompt_lens = column("pen_prompt_lens", p.pen_prompt_lens, torch.int64)
            t.presence = column("presence", p.presence, torch.float32)
            t.frequency = column("frequency", p.frequency, torch.float32)
            t.repetition = column("repetition", p.repetition, torch.float32)
        if p.suppress_rows:
            t.suppress_rows, t.suppress_tokens = dev(p.suppress_rows, torch.int64), dev(p.suppress_tokens, torch.int64)
        if p.lp_counts:
            t.lp_rows = None if p.lp_rows is None else dev(p.lp_rows, torch.int64)
            t.lp_rows_list = list(range(len(p.temperatures))) if p.lp_rows is None else p.lp_rows
            t.lp_counts, t.lp_max = p.lp_counts, p.lp_max
        if p.new_constraints or p.constraint_rows or p.dropped_constraints:
            t._add_constraints(p, constraints if constraints is not None else TokenConstraintStore(device))
        if p.grammar_rows:
            t.grammar_rows = dev(p.grammar_rows, torch.int64)
            if p.grammar_bitmask is not None:  # (None: set_grammar_bitmask, after the forward's launch)
                words = torch.frombuffer(bytearray(p.grammar_bitmask), dtype=torch.int32).view(len(p.grammar_rows), -1)
                t.grammar_bitmask = words.pin_memory().to(device, non_blocking=True) if pin else words
        if p.processors:
            t.processors = p.processors
        return t

    def _add_constraints(self, p: SamplingPlan, store: TokenConstraintStore) -> None:
        store.update(p.new_constraints)
        if p.constraint_rows:
            self.constraints = store.gather(p.constraint_rows, p.constraint_keys)
        store.drop(p.dropped_constraints)  # (after the gather: a one-plan store's keys go now)

    def set_grammar_bitmask(self, bitmask: torch.Tensor, device: torch.device) -> None:
        """The grammar rows' [G, W] int32 bitmask, from a host tensor (pinned on CUDA: the copy does
        not block; its memory is not rewritten before the step has been collected)."""
        self.grammar_bitmask = bitmask.to(device, non_blocking=True) if device.type == "cuda" else bitmask
