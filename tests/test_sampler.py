"""The batched sampler on synthetic logits: filters, penalties, min_tokens, seeds, logprobs."""
import math

import pytest
import torch

from nanoinfer.step.step_message import TokenLogprobs
from nanoinfer.sampling.draw import SAMPLE
from nanoinfer.sampling.noise import hashed_exponential, seed_keys
from nanoinfer.features import FeatureComposition
from nanoinfer.sampling.pipeline import logprobs_to_host, sample_logits
from nanoinfer.sampling.option import Stage
from nanoinfer.sampling_options import pipeline_of, tensors_for
from nanoinfer.sampling_options.penalties import apply_penalties
from nanoinfer.sampling_options.token_constraints import ALLOWED_TOKENS
from nanoinfer.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = (7,)
PIPELINE = pipeline_of(FeatureComposition().sampling_options())  # every registered option's stages, then SAMPLE


class FakeSeq:
    """What tensors_for (the sampling plan) reads from a Sequence."""

    def __init__(self, sp, prompt=(1, 2, 3), output=()):
        self.sampling_params = sp
        self.num_inflight = 0
        self.token_ids = list(prompt) + list(output)
        self.num_prompt_tokens = len(prompt)

    @property
    def num_completion_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def sample(logits, seqs, eos=EOS):
    """The sampled token ids, as a list."""
    return sample_with_logprobs(logits, seqs, eos)[0]


def sample_with_logprobs(logits, seqs, eos=EOS, pipeline=PIPELINE):
    """(token ids, per row its TokenLogprobs or None; None when no row asked)."""
    t = tensors_for(seqs, logits.shape[1], eos, CPU)
    tokens, lp = sample_logits(logits, t, pipeline)
    return tokens.tolist(), None if lp is None else logprobs_to_host(t, len(seqs), lp)


# ---- reference filters (written independently of the sampler, per row, in float64) -----------
def reference_probs(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's order: temperature, min_p, top_k, then top_p on the renormalised distribution."""
    x = logits_row.double() / temperature
    p = torch.softmax(x, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0:
        order = torch.argsort(x, descending=True)
        k_keep = torch.zeros_like(keep)
        k_keep[order[:top_k]] = True
        keep &= k_keep
    q = torch.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1:
        order = torch.argsort(q, descending=True)
        kept, mass = torch.zeros_like(keep), 0.0
        for i in order.tolist():
            if mass >= top_p:
                break
            kept[i] = True
            mass += q[i].item()
        q = torch.where(kept, q, 0.0)
        q /= q.sum()
    return q


def check_distribution(tokens, expected, num_samples):
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    support = expected > 0
    # a token the filter must drop is never sampled
    assert counts[~support].sum() == 0, f"sampled filtered-out tokens {(~support & (counts > 0)).nonzero().flatten().tolist()}"
    exp_counts = expected[support] * num_samples
    chi2 = ((counts[support] - exp_counts) ** 2 / exp_counts).sum().item()
    df = max(int(support.sum()) - 1, 1)
    # mean df, sd sqrt(2 df): 5 sd is far above a correct sampler and far below any wrong filter
    assert chi2 < df + 5 * math.sqrt(2 * df), f"chi2 {chi2:.1f} with df {df}: counts {counts.tolist()} vs {(expected * num_samples).tolist()}"


V = 24
N = 40000


@pytest.fixture(scope="module")
def row():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(V, generator=g) * 1.5


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=0.8, top_k=10, top_p=0.8),
    dict(temperature=1.0, top_k=12, top_p=0.9, min_p=0.05),
])
def test_filtered_distribution(row, params):
    torch.manual_seed(0)
    sp = SamplingParams(**params)
    logits = row.repeat(N, 1)
    tokens = torch.tensor(sample(logits, [FakeSeq(sp)] * N))
    expected = reference_probs(row, params.get("temperature", 1.0), params.get("top_k", 0),
                               params.get("top_p", 1.0), params.get("min_p", 0.0))
    check_distribution(tokens, expected, N)


def test_wrong_filter_is_caught(row):
    """The statistical check rejects a sample from a slightly different filter (sanity of the test)."""
    torch.manual_seed(0)
    tokens = torch.tensor(sample(row.repeat(N, 1), [FakeSeq(SamplingParams(top_p=0.6))] * N))
    right = reference_probs(row, top_p=0.6)
    m = int((right > 0).sum())
    check_distribution(tokens, right, N)
    p = torch.softmax(row.double(), -1)
    for wrong_k in (m - 1, m + 1):  # off-by-one boundaries of the nucleus
        with pytest.raises(AssertionError):
            check_distribution(tokens, reference_probs(row, top_k=wrong_k), N)
    with pytest.raises(AssertionError):  # right support, but not renormalised after the cut
        wrong = torch.where(right > 0, p, 0.0)
        wrong[right.argmax()] += 1 - wrong.sum()
        check_distribution(tokens, wrong, N)


def test_seeded_noise_distribution(row):
    """Seeded rows (a different seed each) sample softmax(logits) too: the hash is a sound RNG."""
    seqs = [FakeSeq(SamplingParams(top_k=8, seed=i)) for i in range(N)]
    tokens = torch.tensor(sample(row.repeat(N, 1), seqs))
    check_distribution(tokens, reference_probs(row, top_k=8), N)
    # and the steps of one seeded request are independent draws too
    seqs = [FakeSeq(SamplingParams(seed=5), output=[0] * i) for i in range(N // 4)]
    tokens = torch.tensor(sample(row.repeat(N // 4, 1), seqs))
    check_distribution(tokens, reference_probs(row), N // 4)


def test_seeded_rows_ignore_batch_and_position(row):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    logits = torch.randn(8, V)
    logits[3] = row
    others = [FakeSeq(SamplingParams(temperature=0.5, top_k=3)) for _ in range(8)]
    alone = sample(row[None], [FakeSeq(sp, output=[1, 2])])[0]
    for pos in range(8):
        batch_logits = torch.randn(8, V)
        batch_logits[pos] = row
        seqs = list(others)
        seqs[pos] = FakeSeq(sp, output=[1, 2])
        torch.manual_seed(pos)  # the global generator state does not matter either
        assert sample(batch_logits, seqs)[pos] == alone
    # different steps draw different noise
    keys = torch.tensor([seed_keys(42, s) for s in range(4)])
    noise = hashed_exponential(keys, V)
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(noise, hashed_exponential(keys, V))


def test_greedy_and_top_k_1():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    greedy = sample(logits, [FakeSeq(SamplingParams(temperature=0))] * 64)
    assert greedy == logits.argmax(-1).tolist()
    assert sample(logits, [FakeSeq(SamplingParams(temperature=1.5, top_k=1))] * 64) == greedy
    mixed = [FakeSeq(SamplingParams(temperature=0 if i % 2 else 1.0)) for i in range(64)]
    out = sample(logits, mixed)
    assert out[1::2] == greedy[1::2]


def test_tiny_temperature_no_nan():
    logits = torch.randn(4, 50) * 100
    logits[0, 3] = float("-inf")
    for temp in (1e-5, 1e-4, 1e-3, 1e-6):
        out = sample(logits, [FakeSeq(SamplingParams(temperature=temp))] * 4)
        assert out == logits.argmax(-1).tolist()
    out = sample(logits, [FakeSeq(SamplingParams(temperature=1e-5, top_p=0.5, min_p=0.5, top_k=3))] * 4)
    assert out == logits.argmax(-1).tolist()


def test_fast_path_leaves_logits_alone():
    logits = torch.randn(4, 50)
    before = logits.clone()
    sample(logits, [FakeSeq(SamplingParams(repetition_penalty=1.5, min_tokens=3, top_k=4))] * 4)
    assert torch.equal(logits, before)
    t = tensors_for([FakeSeq(SamplingParams())] * 4, 50, EOS, CPU)
    assert t.top_k is None and t.top_p is None and t.min_p is None and not t.options  # (no penalties)
    assert t.seeded_rows is None and not t.stages and t.lp_max is None  # (nothing suppressed)


def test_penalties_match_direct_computation():
    torch.manual_seed(0)
    Vp = 40
    params = [SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0),  # no penalty: untouched
              SamplingParams(temperature=0, presence_penalty=1.2, frequency_penalty=0.4),
              SamplingParams(temperature=0, repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=-1.1)]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 6, 7], [8, 9, 10, 11, 12]]
    outputs = [[3, 20, 20, 21], [5, 5], [6, 30, 30, 30, 31], [8]]
    seqs = [FakeSeq(sp, p, o) for sp, p, o in zip(params, prompts, outputs)]
    logits = torch.randn(4, Vp) * 3
    t = tensors_for(seqs, Vp, EOS, CPU)
    got = logits.clone()
    apply_penalties(got, t)
    want = logits.clone()
    for i, (sp, p, o) in enumerate(zip(params, prompts, outputs)):
        for tok in set(p) | set(o):
            x = want[i, tok]
            want[i, tok] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        for tok in set(o):
            want[i, tok] -= sp.frequency_penalty * o.count(tok) + sp.presence_penalty
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])
    # and the sampler's greedy result is the argmax of the adjusted logits
    assert sample(logits, seqs) == want.argmax(-1).tolist()


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(3, 30)
    logits[:, 7] = 50.0   # EOS
    logits[:, 9] = 40.0   # a stop token id
    sp = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    seqs = [FakeSeq(sp, output=[1]), FakeSeq(sp, output=[1, 2, 3]),
            FakeSeq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9], ignore_eos=True), output=[1])]
    out = sample(logits, seqs)
    assert out[0] not in (7, 9) and out[1] == 7 and out[2] == 7
    seqs = [FakeSeq(SamplingParams(min_tokens=2, stop_token_ids=[9]), output=[]) for _ in range(500)]
    assert not {7, 9} & set(sample(logits[:1].repeat(500, 1), seqs))


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 60) * 2
    params = [SamplingParams(logprobs=3, temperature=0.8, repetition_penalty=1.3),
              SamplingParams(), SamplingParams(logprobs=0, temperature=0), SamplingParams(logprobs=5, top_k=2),
              SamplingParams(logprobs=1, seed=3)]
    out, logprobs = sample_with_logprobs(logits, [FakeSeq(sp) for sp in params])
    lp = torch.log_softmax(logits, -1)
    assert len(logprobs) == len(params) and logprobs[1] is None
    for i, sp in enumerate(params):
        if sp.logprobs is None:
            continue
        assert isinstance(logprobs[i], TokenLogprobs)
        top_ids, top_lps, sampled_lp, rank = (logprobs[i].top_ids, logprobs[i].top_logprobs, logprobs[i].logprob,
                                              logprobs[i].rank)
        assert len(top_ids) == sp.logprobs
        want = lp[i].topk(sp.logprobs)
        assert top_ids == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(top_lps), want.values)
        assert math.isclose(sampled_lp, lp[i, out[i]].item(), abs_tol=1e-6)
        assert rank == int((lp[i] > lp[i, out[i]]).sum()) + 1
    assert sample_with_logprobs(logits, [FakeSeq(SamplingParams())] * 5)[1] is None  # no row asked


def test_plain_fast_path_only_without_token_constraints():
    """The fused CUDA kernel serves plain batches; each token-id feature turns it off."""
    plain = [FakeSeq(SamplingParams(temperature=0.7)), FakeSeq(SamplingParams(temperature=0))]
    assert tensors_for(plain, 50, EOS, CPU).plain
    sp_bad = SamplingParams(bad_words=["x"])
    sp_bad.bad_words_token_ids = [[4]]
    for sp in (SamplingParams(logit_bias={3: 1.0}), SamplingParams(allowed_token_ids=[3]), sp_bad,
               SamplingParams(logits_processors=[lambda ids, row: row])):
        assert not tensors_for(plain + [FakeSeq(sp)], 50, EOS, CPU).plain, sp


def test_logit_bias_allowed_and_bad_words_on_synthetic_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, 40)
    bad = SamplingParams(temperature=0, bad_words=["w"])
    bad.bad_words_token_ids = [[int(logits[2].argmax())], [5, 6, 7]]  # one-token word, and a 3-token one
    params = [SamplingParams(temperature=0, logit_bias={11: 50.0}), SamplingParams(temperature=0),
              bad, SamplingParams(temperature=0, allowed_token_ids=[1, 2, 3])]
    seqs = [FakeSeq(sp) for sp in params]
    before = logits.clone()
    out = sample(logits, seqs)
    assert torch.equal(logits, before)
    assert out[0] == 11 and out[1] == int(logits[1].argmax())
    want2 = logits[2].clone()
    want2[bad.bad_words_token_ids[0][0]] = float("-inf")
    assert out[2] == int(want2.argmax())
    assert out[3] == 1 + int(logits[3, 1:4].argmax())
    # the multi-token word: its last token is banned only right after its first tokens
    logits[2, 7] = 100.0
    assert sample(logits[2:3], [FakeSeq(bad, output=[5])]) == [7]
    assert sample(logits[2:3], [FakeSeq(bad, output=[1, 5, 6])]) != [7]
    assert sample(logits[2:3], [FakeSeq(bad, prompt=(5, 6), output=[])]) == [7]  # output tokens only (vLLM)


def test_allowed_and_bias_hold_for_seeded_sampling():
    logits = torch.zeros(300, 30)
    seqs = [FakeSeq(SamplingParams(seed=i, allowed_token_ids=[4, 9, 20])) for i in range(150)] + \
           [FakeSeq(SamplingParams(seed=i, logit_bias={2: -100.0, 3: 100.0})) for i in range(150)]
    out = sample(logits, seqs)
    assert set(out[:150]) == {4, 9, 20} and set(out[150:]) == {3}


def test_logits_processors_run_on_their_row_with_its_history():
    calls = []

    def two(ids, row):
        calls.append(("two", ids, row.shape))
        row[ids[-1] + 1] = 1e4
        return row

    def three(prompt_ids, ids, row):
        calls.append(("three", prompt_ids, ids))
        return row * 0 + torch.arange(row.shape[0], dtype=row.dtype)  # a new row: its argmax is the last id

    logits = torch.randn(3, 20)
    seqs = [FakeSeq(SamplingParams(temperature=0)), FakeSeq(SamplingParams(temperature=0, logits_processors=[two]), output=[4, 8]),
            FakeSeq(SamplingParams(temperature=0, logits_processors=[three]), prompt=(1, 2), output=[5])]
    out = sample(logits, seqs)
    assert out == [int(logits[0].argmax()), 9, 19]
    assert calls == [("two", [4, 8], (20,)), ("three", [1, 2], [5])]


def test_pipeline_order_and_a_new_stage_plugs_in():
    """The pipeline is one ordered list: a stage added to it (as a grammar bitmask would be, after
    allowed_token_ids) runs in its place and only when it applies; an end placed before SAMPLE (as a
    speculative verifier would be) picks the tokens of the steps it applies to."""
    assert [s.name for s in PIPELINE] == ["logits_processors", "allowed_token_ids", "structured_outputs",
                                          "bad_words, min_tokens", "logit_bias", "penalties", "sample"]
    assert [s.end for s in PIPELINE] == [False] * 6 + [True]
    torch.manual_seed(0)
    logits = torch.randn(3, 30)
    seen = []

    def mask(x, t):  # only token 5 of row 1 and tokens 5, 6 of the others survive, after allowed_token_ids
        seen.append(torch.isinf(x).sum().item())
        x[1, :5] = x[1, 6:] = float("-inf")
        x[[0, 2], :5] = x[[0, 2], 7:] = float("-inf")

    grammar = Stage("grammar", lambda t: t.temperatures.shape[0] == 3, mask)
    i = PIPELINE.index(ALLOWED_TOKENS) + 1
    pipeline = PIPELINE[:i] + (grammar,) + PIPELINE[i:]
    params = [SamplingParams(temperature=0), SamplingParams(seed=1),
              SamplingParams(temperature=0, allowed_token_ids=[6])]
    before = logits.clone()
    out, _ = sample_with_logprobs(logits, [FakeSeq(sp) for sp in params], pipeline=pipeline)
    assert torch.equal(logits, before)  # the caller's logits are left alone
    assert out == [5 + int(logits[0, 6] > logits[0, 5]), 5, 6] and seen == [29]  # after allowed: 29 of row 2 -inf
    assert sample_with_logprobs(logits[:2], [FakeSeq(sp) for sp in params[:2]], pipeline=pipeline)[0] == \
        sample(logits[:2], [FakeSeq(sp) for sp in params[:2]])  # does not apply: as without it
    verify = Stage("verify", lambda t: t.any_greedy, lambda x, t: torch.full((x.shape[0],), 4), end=True)
    pipeline = PIPELINE[:-1] + (verify, SAMPLE)
    assert sample_with_logprobs(logits, [FakeSeq(sp) for sp in params], pipeline=pipeline)[0] == [4, 4, 4]
    assert sample_with_logprobs(logits[1:2], [FakeSeq(params[1])], pipeline=pipeline)[0] == \
        sample(logits[1:2], [FakeSeq(params[1])])


def _vocab_shard_rank(rank, port, results):
    """A rank of test_two_gpus_sample_their_vocabulary_shards: NCCL, its half of every row's logits."""
    import torch.distributed as dist

    from nanoinfer.kernels.sampling import sample_gumbel_argmax
    from nanoinfer.sampling.sampler import sample_vocab_shard
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    try:
        V = 151936  # Qwen3's vocabulary: each half ends inside a 4096-column tile
        same = []
        for B in (1, 37, 256):  # different chunk counts
            g = torch.Generator().manual_seed(B)  # every rank makes the same full rows
            full = (torch.randn(B, V, generator=g) * 3).to(device, torch.bfloat16)
            full[0, [V // 2 - 1, V // 2]] = 40.0  # a tie across the ranks' boundary
            temps = torch.tensor([0.0, 0.6, 1.0, 0.0][:B] * (B // 4) + [0.0, 0.6, 1.0][:B % 4], device=device)
            shard = full[:, rank * V // 2:(rank + 1) * V // 2].contiguous()
            for seed in (1, 2**31 - 2):
                tokens = sample_vocab_shard(shard, temps, seed, rank * V // 2)
                same.append(torch.equal(tokens, sample_gumbel_argmax(full, temps, seed)))
            same.append(int(sample_vocab_shard(shard, temps, 3, rank * V // 2)[0]) == V // 2 - 1)
        results[rank] = same
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_sample_their_vocabulary_shards():
    """Each GPU samples its half of the vocabulary and they exchange their winners over NCCL: both
    get the tokens the fused kernel takes on the full rows (same noise per column, ties to the
    smaller index)."""
    import torch.multiprocessing as mp

    from nanoinfer.engine.tp_executor import free_port
    results = mp.Manager().dict()
    mp.spawn(_vocab_shard_rank, args=(free_port(), results), nprocs=2)
    assert dict(results) == {0: [True] * 9, 1: [True] * 9}


def test_which_steps_sample_inside_the_decode_graphs():
    """engine/graph_runner.py sample_decode serves one rank's decode-only steps whose rows all sample
    at temperature alone (greedy included), a row's last token each; everything else samples
    after the forward (the logits pipeline, a grammar's mask, prompt logprobs, a row per token)."""
    from nanoinfer.prompt_logprobs.rows import PromptLogprobsRequest
    from nanoinfer.step.step_message import SampleInput, StepInput
    from nanoinfer.sampling.sampler import Sampler

    cuda = torch.device("cuda")  # (a device name only: nothing here touches a GPU)

    def decision(step=None, args=None, prompt_logprobs=None, world_size=1, device=cuda, **params):
        step = step or StepInput(2, [5, 9], [1, 1], [3, 4], [[0], [1]])
        seqs = [FakeSeq(SamplingParams(**params)), FakeSeq(SamplingParams(**params))]
        args = args or tensors_for(seqs, 32, EOS, CPU)
        sample = SampleInput(None, prompt_logprobs)
        return Sampler(None, 0, world_size, device).fused_in_graph(step, sample, args)

    assert decision(temperature=0.7) and decision(temperature=0)
    assert not decision(temperature=0.7, top_p=0.9) and not decision(temperature=0.7, logprobs=2)
    assert not decision(temperature=0.7, world_size=2) and not decision(temperature=0.7, device=CPU)
    mixed = StepInput(1, [5, 0], [1, 3], [3, 4, 5, 6], [[0], [1]])  # a prompt chunk
    assert not decision(step=mixed, temperature=0.7)
    short = StepInput(2, [5, 9], [1, 1], [3, 4], [[0], [1]], sample_rows=[1])
    assert not decision(step=short, temperature=0.7)
    assert not decision(temperature=0.7, prompt_logprobs=PromptLogprobsRequest([], [], 0))
    grammar = tensors_for([FakeSeq(SamplingParams(temperature=0.7))] * 2, 32, EOS, CPU)
    grammar.grammar_rows = torch.tensor([0])
    assert not decision(args=grammar)
