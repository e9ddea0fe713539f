"""The sampling dispatch (sampling/sampler.py): which route samples a step, and the route that waits
for a grammar bitmask running the step's forward once. CPU only: a device name touches no GPU."""
import torch

from nanoinfer.engine.graph_runner import StepForward
from nanoinfer.prompt_logprobs.rows import PromptLogprobsRequest
from nanoinfer.step.step_message import PlainSample, SampleInput, SamplingPlan, StepInput
from nanoinfer.sampling.plan import build_sampling_plan
from nanoinfer.sampling.sampler import Route, Sampler, vocab_shard_sample
from nanoinfer.sampling.tensors import SamplingTensors
from nanoinfer.sampling_options import tensors_for
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.sampling_options.grammar import GrammarRows

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
EOS = (7,)


class FakeSeq:
    def __init__(self, sp):
        self.sampling_params = sp
        self.num_inflight = 0
        self.token_ids = [1, 2, 3]
        self.num_prompt_tokens = 3
        self.num_completion_tokens = 0


def decode_step(**fields) -> StepInput:
    return StepInput(2, [5, 9], [1, 1], [3, 4], [[0], [1]], **fields)


def tensors(**params) -> SamplingTensors:
    return tensors_for([FakeSeq(SamplingParams(**params))] * 2, 32, EOS, CPU)


def test_each_step_takes_one_route():
    """Rank 0 of one CUDA rank samples a plain decode step inside the graphs; a step whose ranks
    sample their shards (tensor parallel) does so on every rank; a grammar step whose bitmask comes
    after the launch waits for it, then (bitmask in) is gathered, as every other step is."""
    one_gpu, rank1_of_2 = Sampler(None, 0, 1, CUDA), Sampler(None, 1, 2, CUDA)
    plain = SampleInput(None)
    assert one_gpu.route(decode_step(), plain, tensors(temperature=0.7)) is Route.IN_GRAPH
    assert one_gpu.route(decode_step(), plain, tensors(temperature=0.7, top_p=0.9)) is Route.GATHERED
    assert Sampler(None, 0, 1, CPU).route(decode_step(), plain, tensors(temperature=0.7)) is Route.GATHERED
    shards = decode_step(plain_sample=PlainSample([0.7, 0.7], 3))
    assert rank1_of_2.route(shards, None, None) is Route.VOCAB_SHARDS
    assert Sampler(None, 0, 2, CUDA).route(shards, plain, tensors(temperature=0.7)) is Route.VOCAB_SHARDS
    assert rank1_of_2.route(decode_step(), None, None) is Route.GATHERED
    grammar = tensors(temperature=0.7)
    grammar.grammar_rows = torch.tensor([0])
    assert one_gpu.route(decode_step(), plain, grammar) is Route.AWAITING_MASK
    grammar.set_grammar_bitmask(torch.full((1, 1), -1, dtype=torch.int32), CPU)
    assert one_gpu.route(decode_step(), plain, grammar) is Route.GATHERED


def test_the_ranks_sample_their_shards_only_for_plain_steps_without_prompt_logprobs():
    plan = SamplingPlan([0.7, 0.0], all_greedy=False, any_greedy=True, seed=11)
    assert vocab_shard_sample(SampleInput(plan), True) == PlainSample([0.7, 0.0], 11)
    assert vocab_shard_sample(SampleInput(plan), False) is None
    assert vocab_shard_sample(SampleInput(plan, PromptLogprobsRequest([], [], 1)), True) is None
    filtered = SamplingPlan([0.7, 0.0], all_greedy=False, any_greedy=True, top_p=[0.9, 1.0])
    assert vocab_shard_sample(SampleInput(filtered), True) is None


class OneRankHead:
    def gather(self, logits):
        return logits


class CountingGraphs:
    """A graph runner whose forward gives the test's logits, counting how often it runs."""

    def __init__(self, logits):
        self.value, self.runs = logits, 0

    def forward(self, input_ids, positions, decode_only):
        self.runs += 1
        return self.value


def test_a_step_awaiting_its_bitmask_samples_the_logits_its_launch_computed():
    sampler = Sampler(OneRankHead(), 0, 1, CPU)
    plan = build_sampling_plan([FakeSeq(SamplingParams(temperature=0))] * 2, 32, EOS)
    plan.options = [GrammarRows([1], None)]  # (row 1's mask: after the launch)
    args = SamplingTensors.from_plan(plan, CPU)
    logits = torch.zeros(2, 32)
    logits[:, 5] = 1.0  # the argmax, which row 1's grammar forbids: it gets 9, the best it allows
    logits[:, 9] = 0.5
    graphs = CountingGraphs(logits)
    forward, step = StepForward(graphs, torch.tensor([3, 4]), torch.tensor([5, 9])), decode_step()
    assert sampler.sample(step, SampleInput(None), args, forward).tokens is None and graphs.runs == 1
    allowed = torch.zeros(1, 1, dtype=torch.int32)
    allowed[0, 0] = 1 << 9
    args.set_grammar_bitmask(allowed, CPU)
    assert sampler.sample(step, SampleInput(None), args, forward).tokens.tolist() == [5, 9]
    assert graphs.runs == 1
