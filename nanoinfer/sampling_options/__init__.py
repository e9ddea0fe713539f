"""The per-request logits options of SamplingParams, each a SamplingOption (sampling/option.py)
that the composition place registers (nanoinfer/features.py), as vLLM V1 attaches its built-in
logits processors. A plain request (temperature, top-k, top-p, min-p, seed, logprobs) uses none.

    logits_processors.py    user callables, on the host (order 10)
    token_constraints.py    allowed_token_ids (20), logit_bias (50) and one-token bad words, kept on
                            the sampling rank by key (constraint_registry.py, constraint_store.py)
    suppression.py          min_tokens and bad words (40)
    penalties.py            repetition, frequency, presence (60)
    grammar.py              structured outputs' grammar masks (30), applied by token_mask.py;
                            registered beside default_options (features.py)
"""
from nanoinfer.sampling.draw import SAMPLE
from nanoinfer.sampling.option import Stage
from nanoinfer.sampling.plan import build_sampling_plan
from nanoinfer.sampling.tensors import SamplingTensors
from nanoinfer.sampling_options.logits_processors import LogitsProcessors
from nanoinfer.sampling_options.penalties import Penalties
from nanoinfer.sampling_options.suppression import Suppression
from nanoinfer.sampling_options.token_constraints import TokenConstraintsOption


def default_options(ephemeral: bool = False, store=None) -> list:
    """The options, new (one engine's: their registry is its own). `ephemeral`: for one plan at a
    time (tests, benchmarks); `store`: the sampling rank's token constraint store when it is in this
    process (a draft model's; token_constraints.rank_store)."""
    constraints = TokenConstraintsOption(ephemeral, store)
    # (suppression first: it indexes a request's bad words before the constraints' plan ends)
    return [LogitsProcessors(), Suppression(constraints.registry), constraints, Penalties()]


def pipeline_of(options) -> tuple[Stage, ...]:
    """The whole logits pipeline of these options: their stages in order, then SAMPLE (a step runs
    those of the options its rows use: SamplingTensors.stages)."""
    stages = dict.fromkeys(s for option in options for s in option.stages)
    return (*sorted(stages, key=lambda s: s.order), SAMPLE)


def tensors_for(seqs, vocab_size: int, eos_token_ids, device, options=None) -> SamplingTensors:
    """A batch's SamplingTensors with no step in flight, every option made for this plan alone
    (tests, benchmarks; `options`: others)."""
    options = default_options(ephemeral=True) if options is None else options
    return SamplingTensors.from_plan(build_sampling_plan(seqs, vocab_size, eos_token_ids, options=options), device)
