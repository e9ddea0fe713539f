"""Sampling for one rank: THE sampling dispatch, from a prepared step to its tokens.

`prepare` turns the step's SamplingPlan into device tensors before the forward (their copies
overlap it). `sample` picks the step's route (`route`, the one place that does) and runs it, a
method per route, each asking the step's forward (engine/graph_runner.py, StepForward) for what it
needs. A row whose logits are not finite gets the token NON_FINITE (-1): the engine fails its request.
"""
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from nanoinfer.step.step_message import PlainSample, SampleInput, StepInput
from nanoinfer.kernels.sampling import gumbel_argmax_partials, pick_token
from nanoinfer.sampling.column_cache import ColumnCache
from nanoinfer.sampling.pipeline import logprobs_to_host, sample_logits
from nanoinfer.sampling.tensors import SamplingTensors


class Route(Enum):
    IN_GRAPH = "inside the decode graph"
    VOCAB_SHARDS = "on the vocabulary shards"
    AWAITING_MASK = "after the grammar bitmask"
    GATHERED = "gathered to rank 0"


class SamplingFailed(Exception):
    """Sampling raised on rank 0 after the forward; the other ranks were kept in step."""


@dataclass(slots=True)
class Sampled:
    """A step's sampling output on the device."""
    tokens: torch.Tensor | None        # [rows] int64; None: the step awaits its grammar bitmask
    args: SamplingTensors | None = None
    logprobs: tuple | None = None      # the sampled rows' logprob tensors, when asked
    outputs: dict | None = None        # key -> a callable giving its host value once the step's copies are done
    inputs: torch.Tensor | None = None  # the tokens as the next step's inputs (NON_FINITE rows read token 0)

    def __post_init__(self):
        # (a row marked NON_FINITE is failed by the host; an overlapped next step may still read it)
        if self.inputs is None and self.tokens is not None:
            self.inputs = self.tokens.clamp_min(0)


def vocab_shard_sample(sample: SampleInput, on_shards: bool) -> PlainSample | None:
    """What every rank needs to sample its shard (Route.VOCAB_SHARDS), or None: decided when the
    step is encoded, since only rank 0 gets the plan. `on_shards`: tensor parallelism on CUDA."""
    plan = sample.plan
    if not on_shards or not plan.plain or sample.extra_logits is not None:
        return None
    return PlainSample(plan.temperatures, plan.seed)


def sample_vocab_shard(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col0: int) -> torch.Tensor:
    """Each rank samples its shard of the vocabulary (`logits`, columns from col0), the ranks
    all-gather their rows' per-chunk winners (a few bytes a row instead of the logits), and every
    rank picks the same tokens [B]: those the fused kernel takes on the full rows with this seed."""
    parts = gumbel_argmax_partials(logits, temperatures, seed, col0)
    everyone = parts.new_empty((dist.get_world_size(), *parts.shape))
    dist.all_gather_into_tensor(everyone, parts)
    return pick_token(everyone)


class Sampler:
    def __init__(self, lm_head, rank: int, world_size: int, device: torch.device, features=()):
        """features: the rank's RankFeatures (step/feature.py), which may read logits (read_logits)."""
        self.lm_head = lm_head  # gathers the logits' vocabulary shards; knows this rank's first column
        self.rank, self.world_size, self.device = rank, world_size, device
        self.features = features
        self.columns = ColumnCache(device)  # the last step's per-row option tensors
        self.option_states: dict = {}  # the sampling options' state on this rank (sampling/option.py)
        # one rank on CUDA: decode steps may sample inside the graphs (which then capture it)
        self.samples_in_graphs = world_size == 1 and device.type == "cuda"

    def prepare(self, sample: SampleInput | None, prev_tokens: torch.Tensor | None) -> SamplingTensors | None:
        """The plan's device tensors (rank 0); `prev_tokens`: the step in flight's, which options read."""
        if sample is None:
            return None
        return SamplingTensors.from_plan(sample.plan, self.device, prev_tokens, self.columns, self.option_states)

    def route(self, step: StepInput, sample: SampleInput | None, args: SamplingTensors | None) -> Route:
        """The route that samples this step on this rank."""
        if step.plain_sample is not None:
            return Route.VOCAB_SHARDS
        if args is not None and args.grammar_rows is not None and args.grammar_bitmask is None:
            return Route.AWAITING_MASK
        if self.fused_in_graph(step, sample, args):
            return Route.IN_GRAPH
        return Route.GATHERED

    def fused_in_graph(self, step: StepInput, sample: SampleInput | None, args: SamplingTensors | None) -> bool:
        """Whether this step may sample inside the decode graphs (GraphRunner.sample_decode): one
        rank, a decode-only step whose rows all sample at temperature alone, no grammar."""
        return (self.samples_in_graphs and step.is_decode_only and args is not None and args.plain
                and args.grammar_rows is None and step.sample_rows is None
                and not step.extra_logit_rows and sample.extra_logits is None)

    def sample(self, step: StepInput, sample: SampleInput | None, args: SamplingTensors | None,
               forward) -> Sampled:
        """The step's tokens on every rank, by its route. `forward`'s logits are this rank's shard,
        the step's rows first, then its extra_logit_rows."""
        route = self.route(step, sample, args)
        if route is Route.IN_GRAPH:
            return self.sample_in_graph(step, sample, args, forward)
        if route is Route.VOCAB_SHARDS:
            return self.sample_on_vocab_shards(step, args, forward)
        if route is Route.AWAITING_MASK:  # sampled when called again with the bitmask set
            forward.logits()  # (launched now; kept until the bitmask comes)
            return Sampled(None, args)
        return self.sample_gathered(step, sample, args, forward)

    def sample_in_graph(self, step: StepInput, sample: SampleInput, args: SamplingTensors, forward) -> Sampled:
        """The LM head and the fused kernel replayed after the decode graph's forward, with the rows'
        temperatures and the step's seed; a step no sampling graph holds is gathered (on one rank:
        the fused kernel after the forward)."""
        out = forward.sample_in_graph(args.temperatures, args.seed)
        if out is None:
            return self.sample_gathered(step, sample, args, forward)
        return Sampled(out[0], args, inputs=out[1])

    def sample_on_vocab_shards(self, step: StepInput, args: SamplingTensors | None, forward) -> Sampled:
        """Tensor parallelism on CUDA, rows at temperature alone: every rank samples its shard."""
        plain = step.plain_sample
        temps = args.temperatures if args is not None else \
            self.columns.get("temperatures", plain.temperatures, torch.float32)
        return Sampled(sample_vocab_shard(forward.logits(), temps, plain.seed, self.lm_head.vocab_start), args)

    def sample_gathered(self, step: StepInput, sample: SampleInput | None, args: SamplingTensors | None,
                        forward) -> Sampled:
        """Rank 0 gathers the full rows, hands the features those they read (extra_logit_rows), runs
        the logits pipeline and, with tensor parallelism, broadcasts the tokens."""
        rows, logits = step.num_sample_rows, forward.logits()
        if sample is None:  # a rank that does not sample: its shard goes to rank 0, the tokens come back
            self.lm_head.gather(logits)
            tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
            dist.broadcast(tokens, 0)
            return Sampled(tokens)
        logits = self.lm_head.gather(logits)  # the full rows
        outputs = None
        if step.extra_logit_rows:  # (after the sampling rows)
            outputs = {}
            for feature in self.features:
                outputs.update(feature.read_logits(step, sample, logits[rows:]) or ())
            logits = logits[:rows]
        try:
            tokens, logprobs = sample_logits(logits, args)
        except Exception as e:  # e.g. a user's logits processor
            if self.world_size == 1:
                raise
            dist.broadcast(torch.zeros(rows, dtype=torch.int64, device=self.device), 0)  # the others wait
            raise SamplingFailed(f"{type(e).__name__}: {e}") from e
        tokens = tokens.to(torch.int64)  # (NON_FINITE rows marked by the pipeline)
        if self.world_size > 1:
            dist.broadcast(tokens, 0)
        return Sampled(tokens, args, logprobs, outputs)

    @staticmethod
    def to_host(sampled: Sampled, rows: int) -> tuple[list | None, dict | None]:
        """(per-row TokenLogprobs or None, the features' outputs or None), once the step's tokens
        have reached the host."""
        logprobs = None
        if sampled.logprobs is not None:
            logprobs = logprobs_to_host(sampled.args, rows, sampled.logprobs)
        outputs = sampled.outputs and {key: finish() for key, finish in sampled.outputs.items()}
        return logprobs, outputs or None
