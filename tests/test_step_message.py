"""StepEncoder: what every rank gets, and when the ranks sample their vocabulary shards."""
import pickle
import random

import pytest

from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.step.sequence import Sequence
from nanoinfer.engine.step_encoder import StepEncoder
from nanoinfer.prompt_logprobs.feature import PromptLogprobsFeature
from nanoinfer.sampling_params import SamplingParams

EOS = frozenset({7})


def batch(params: list[SamplingParams]) -> ScheduledBatch:
    seqs = [Sequence([1, 2, 3, 4 + i], sp, 16) for i, sp in enumerate(params)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
    return ScheduledBatch(seqs, [0] * len(seqs), [4] * len(seqs), [True] * len(seqs), 0)


@pytest.mark.parametrize("params, plain", [
    ([SamplingParams(temperature=0.6), SamplingParams(temperature=0)], True),
    ([SamplingParams(temperature=0.6), SamplingParams(top_k=5)], False),
    ([SamplingParams(temperature=0.6, logprobs=1)], False),
    ([SamplingParams(temperature=0.6, seed=3)], False),
    ([SamplingParams(temperature=0.6, prompt_logprobs=1)], False),  # its prompt's logits go to rank 0
])
def test_plain_steps_sample_on_the_shards(params, plain):
    b = batch(params)
    features = [PromptLogprobsFeature(None)]  # (what reads the prompt's logits)
    step, sample = StepEncoder(100, EOS, random.Random(5), True, features).encode(b, None)
    if plain:
        temps, seed = step.plain_sample.temperatures, step.plain_sample.seed
        assert temps == sample.plan.temperatures == [0.6 if sp.temperature else 0.0 for sp in params]
        assert seed == sample.plan.seed == random.Random(5).randrange(2**31 - 1)
        assert pickle.loads(pickle.dumps(step)).plain_sample == step.plain_sample  # (sent to every rank)
    else:
        assert step.plain_sample is None
    off, _ = StepEncoder(100, EOS, random.Random(5), False, features).encode(b, None)
    assert off.plain_sample is None  # one rank, or CPU: rank 0 samples the full rows


def test_the_seeds_come_from_the_engines_generator():
    """Plain steps draw their seed from the generator given (the engine's, seeded from its config):
    the same sequence of seeds for the same config, whatever Python's default generator does."""
    b = batch([SamplingParams(temperature=0.6)] * 3)
    runs = []
    for _ in range(2):
        seeds = random.Random(11)
        random.random()  # the default generator moves on between runs
        encoder = StepEncoder(100, EOS, seeds, True)
        runs.append([encoder.encode(b, None)[0].plain_sample.seed for _ in range(4)])
    assert runs[0] == runs[1] and len(set(runs[0])) == 4
