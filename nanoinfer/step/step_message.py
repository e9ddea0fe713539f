"""The step message: what the engine sends a runner for one step, and what comes back.

A leaf of plain, typed dataclasses that import nothing of the engine, the layers or torch. Every
rank gets the StepInput; the rank that samples also gets the SampleInput and answers with a
StepResult. Rows are held column by column (lists of ints), not as an object per row, because the
step is rebuilt, and with tensor parallelism pickled, every step. A feature's part of a step is a
dataclass of its own folder, held in StepInput.parts under the feature's key.
"""
from dataclasses import dataclass, field


@dataclass(slots=True)
class PlainSample:
    """What every rank needs to sample its shard of the vocabulary (Route.VOCAB_SHARDS)."""
    temperatures: list[float]
    seed: int


@dataclass(slots=True)
class StepInput:
    """What every rank needs. Decode rows (one query token each) come first, then prompt chunks.
    A decode row whose input token the step still in flight sampled holds 0 in `input_ids` and is
    listed in `inflight_rows` (its flat index is its row), with that step's row which sampled it in
    `inflight_sources`: every rank reads the token from that step's device tensor."""
    num_decode: int
    starts: list[int]              # per row: the first position it computes
    query_lens: list[int]          # per row: how many tokens it computes
    input_ids: list[int]           # flat, sum(query_lens) entries
    block_tables: list[list[int]]  # per row: its sequence's blocks
    inflight_rows: list[int] = field(default_factory=list)
    inflight_sources: list[int] = field(default_factory=list)
    extra_logit_rows: list[int] | None = None  # flat token rows whose logits a feature reads (read_logits)
    sample_rows: list[int] | None = None  # flat token rows that sample (None: each row's last; rows of several: all)
    plain_sample: PlainSample | None = None
    prefill: bool = False  # every row runs as a prefill, however short (a feature's step: images, embeddings)
    parts: dict | None = None  # the features' parts of the step, by key (None: none has one)

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.starts)

    @property
    def num_sample_rows(self) -> int:
        return self.num_rows if self.sample_rows is None else len(self.sample_rows)

    def part(self, key: str):
        """A feature's part of the step, or None."""
        return self.parts.get(key) if self.parts else None

    def add_part(self, key: str, value) -> None:
        if self.parts is None:
            self.parts = {}
        self.parts[key] = value


@dataclass(slots=True)
class SamplingPlan:
    """A step's sampling options as plain lists, one entry per row (or per row that uses the
    option): built by sampling/plan.py, made device tensors by sampling/tensors.py."""
    temperatures: list[float]
    all_greedy: bool
    any_greedy: bool
    top_k: list[int] | None = None
    max_top_k: int = 0
    top_p: list[float] | None = None
    min_p: list[float] | None = None
    seeded_rows: list[int] | None = None
    seed_keys: list[list[int]] | None = None
    lp_rows: list[int] | None = None           # None: every row (when lp_counts is set)
    lp_counts: list[int] | None = None
    lp_max: int | None = None
    options: list | None = None                # the registered options' payloads (OptionPayload), in order
    seed: int | None = None                    # fused plans: the fused kernel's noise seed, in [0, 2^31)

    @property
    def fused(self) -> bool:
        """Only temperature / greedy rows, after any token mask: what the fused kernel does on its
        own (kernels/sampling.py) once the mask is applied."""
        return (self.top_k is None and self.top_p is None and self.min_p is None and not self.seeded_rows
                and self.lp_counts is None
                and (self.options is None or all(p.before_fused or not p.edits for p in self.options)))

    @property
    def plain(self) -> bool:
        """Fused and without a token mask (only rank 0 gets the plan): every rank can sample its
        vocabulary shard alone."""
        return self.fused and (self.options is None or not any(p.edits for p in self.options))

    @property
    def eager(self) -> bool:
        """An option runs user code (logits processors): the step samples, and reports, at once."""
        return self.options is not None and any(p.eager for p in self.options)

    def payload(self, name: str):
        """The step's payload of the option named `name`, or None."""
        return next((p for p in self.options or () if p.name == name), None)


@dataclass(slots=True)
class SampleInput:
    """What the sampling rank needs besides the StepInput."""
    plan: SamplingPlan
    extra_logits: object = None  # the work of the feature that reads StepInput.extra_logit_rows' logits


@dataclass(slots=True)
class TokenLogprobs:
    """One position's logprobs: the top entries (most likely first), the chosen token's logprob and
    rank (1: the most likely)."""
    top_ids: list[int]
    top_logprobs: list[float]
    logprob: float
    rank: int

    def __reduce__(self):  # pickled as its constructor's arguments: far cheaper than a state dict
        return TokenLogprobs, (self.top_ids, self.top_logprobs, self.logprob, self.rank)


@dataclass(slots=True)
class StepResult:
    """A step's outcome, on the host."""
    tokens: list[int]  # a token per row
    logprobs: list[TokenLogprobs | None] | None = None  # per row, when it asked (None: no row did)
    outputs: dict | None = None  # what the features read on the rank, by the key each gives
