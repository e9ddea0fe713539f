"""The fused Triton sampling kernel (CPU: Triton interpreter, small shapes; GPU: real), and when the
pipeline uses it."""
import math

import pytest
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.sampling import _log_exponential, sample_gumbel_argmax
from nanoinfer.sampling import pipeline as pipeline_mod
from nanoinfer.sampling.pipeline import sample_logits
from nanoinfer.sampling_options import tensors_for
from nanoinfer.sampling_params import SamplingParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On CPU a tile is 128 logits: these split a row of a few hundred into one chunk of several tiles,
# chunks of two tiles, and one tile per chunk.
CONFIGS = [None, {"max_chunks": 1}, {"max_chunks": 2}]


def temps(values):
    return torch.tensor(values, dtype=torch.float32, device=DEV)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_is_argmax_first_index(dtype, config):
    torch.manual_seed(0)
    V = 300  # not a multiple of the tile: the last one is masked
    x = torch.randn(6, V)
    for row, cols in enumerate([(7, 39), (40, 33), (133, 261), (299, 150), (299,)]):
        x[row, list(cols)] = 10.0  # ties within a lane, across lanes, tiles and chunks; the last column
    x = x.to(DEV, dtype)
    out = sample_gumbel_argmax(x, temps([0.0] * 6), seed=1, config=config)
    assert out.dtype == torch.int64 and out.device == x.device
    assert out.tolist() == [7, 33, 133, 150, 299, int(x[5].float().argmax())]
    assert out.tolist() == x.float().argmax(-1).tolist()  # torch's argmax also takes the first max


def test_mixed_batch():
    torch.manual_seed(0)
    V = 300
    x = torch.randn(8, V)
    x[1, 17] = 40.0  # dominant: sampled at any of these temperatures
    x[4, [50, 9, 70, 130, 200, 260, 280, 290]] = 9.0  # tied maxima: greedy takes the first, noise would not
    x[5, 250] = x[5].max() + 1  # a clear winner under a tiny (but not greedy) temperature
    t = [0.0, 0.7, 0.0, 1.5, 1e-6, 1e-4, 0.0, 3.0]  # 1e-6 < SAMPLING_EPS: greedy
    out = sample_gumbel_argmax(x.to(DEV), temps(t), seed=3).tolist()
    greedy = x.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4, 6)] == [greedy[i] for i in (0, 2, 4, 6)]
    assert out[1] == 17 and out[4] == 9 and out[5] == 250
    assert all(0 <= tok < V for tok in out)
    # with the sampled rows at a high temperature, they do not all land on the argmax
    hot = sample_gumbel_argmax(x.to(DEV), temps([0.0, 50.0] * 4), seed=3).tolist()
    assert hot[0::2] == greedy[0::2] and hot[1::2] != greedy[1::2]


def test_neg_inf_never_sampled():
    V = 200
    x = torch.randn(8, V) * 3
    x[:6, ::2] = float("-inf")  # the even columns, incl. the largest logits of some rows
    x[:6, 1::2] -= 20
    x[6] = float("-inf")  # a whole row: NON_FINITE (-1), nothing to sample
    x[7] = float("-inf")
    x[7, 123] = -5.0  # a single finite entry
    out = sample_gumbel_argmax(x.to(DEV), temps([1.0, 100.0, 0.0, 0.5, 1.0, 100.0, 1.0, 1.0]), seed=5)
    out = out.tolist()
    assert all(tok % 2 == 1 for tok in out[:6])
    assert out[6] == -1 and out[7] == 123
    assert sample_gumbel_argmax(x[6:].to(DEV), temps([0.0, 0.0]), seed=5).tolist()[1] == 123


# ---- distribution ------------------------------------------------------------------------------
# 16 logits (columns permuted) at temperature 0.25: softmax(x / T) spans 0.2 down to 0.01.
T = 0.25
ROW = torch.linspace(0, -0.75, 16)[torch.tensor([5, 0, 12, 3, 15, 9, 1, 7, 14, 2, 11, 6, 13, 4, 10, 8])]
N = 200


def chi2_ok(counts, expected, n):
    """Pearson chi-square with the tail bins (expected < 5) merged; mean df, sd sqrt(2 df): 5 sd."""
    order = expected.argsort(descending=True)
    counts, exp_counts = counts[order], expected[order] * n
    keep = int((exp_counts >= 5).sum())
    if keep < len(counts):
        counts = torch.cat([counts[:keep], counts[keep:].sum()[None]])
        exp_counts = torch.cat([exp_counts[:keep], exp_counts[keep:].sum()[None]])
    chi2 = ((counts - exp_counts) ** 2 / exp_counts).sum().item()
    df = len(counts) - 1
    return chi2 < df + 5 * math.sqrt(2 * df)


def test_distribution_is_softmax_over_temperature():
    out = sample_gumbel_argmax(ROW.repeat(N, 1).to(DEV), temps([T] * N), seed=11)
    counts = torch.bincount(out.cpu(), minlength=16).double()
    assert chi2_ok(counts, torch.softmax(ROW.double() / T, -1), N)
    # the test tells the right formula from plausible wrong ones
    g = torch.Generator().manual_seed(0)
    noise = -torch.empty(200_000, 16, dtype=torch.float64).exponential_(generator=g).log()
    sign_error = torch.bincount((ROW.double() / T - noise).argmax(-1), minlength=16) / 200_000.0
    for wrong in (torch.softmax(ROW.double(), -1), torch.softmax(ROW.double() * T, -1), sign_error):
        assert not chi2_ok(counts, wrong, N)


@triton.jit
def _noise_kernel(r_ptr, out_ptr, N: tl.constexpr, FAST: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _log_exponential(tl.load(r_ptr + offs).to(tl.uint32), FAST))


def test_noise_keeps_32_bits():
    """log E from 32 random bits r: E = -log(1 - W), W = (r + 0.5) / 2^32, to float32 accuracy also
    for tiny W (where rare tokens win; 1 - W itself would round them away) and at r = 2^32 - 1."""
    r = torch.tensor([0, 1, 7, 1000, 2**20, 2**24 + 3, 2**31, 3 * 2**30, 2**32 - 2**20, 2**32 - 1,
                      5, 6, 8, 9, 10, 11], dtype=torch.int64)
    out = torch.empty(16, dtype=torch.float32, device=DEV)
    _noise_kernel[(1,)](r.to(DEV), out, N=16, FAST=DEV == "cuda")
    w = ((r.double() + 0.5) / 2**32).clamp(max=1 - 2**-24)
    torch.testing.assert_close(out.cpu().double(), torch.log(-torch.log1p(-w)), rtol=0, atol=1e-4)


# ---- the noise: a function of (seed, row, column) only ------------------------------------------
def test_seeds_rows_and_chunking():
    x = torch.zeros(16, 200, device=DEV)  # uniform: every token equally likely
    t = temps([1.0] * 16)
    a = sample_gumbel_argmax(x, t, seed=1)
    assert torch.equal(a, sample_gumbel_argmax(x, t, seed=1))
    assert not torch.equal(a, sample_gumbel_argmax(x, t, seed=2))
    assert len(set(a.tolist())) > 10  # each row its own stream
    assert max(a.tolist()) >= 128  # and fresh noise in each tile (of 128 on CPU)
    assert torch.equal(a, sample_gumbel_argmax(x, t, seed=1, config={"max_chunks": 1}))  # other chunking
    assert torch.equal(a[:5], sample_gumbel_argmax(x[:5], t[:5], seed=1))  # whatever the batch size


def test_a_seed_read_from_the_device_samples_as_the_same_seed_given():
    """What a CUDA graph replays (engine/graph_runner.py): the seed in a device tensor, the tokens
    into a given buffer."""
    x = torch.zeros(6, 300, device=DEV)
    t = temps([1.0, 0.0, 0.5, 2.0, 1.0, 0.0])
    x[1, 17] = 1.0  # the greedy rows' argmax
    x[5, 250] = 1.0
    for seed in (0, 5, 2**31 - 2):
        out = torch.full((6,), -7, dtype=torch.int64, device=DEV)
        got = sample_gumbel_argmax(x, t, torch.tensor([seed], device=DEV), out=out)
        assert got is out and torch.equal(out, sample_gumbel_argmax(x, t, seed))
        assert out[1] == 17 and out[5] == 250


def test_row_stride():
    torch.manual_seed(0)
    V = 300
    wide = torch.randn(5, V + 37, device=DEV, dtype=torch.bfloat16)
    x = wide[:, 5:5 + V]  # row stride V + 37, rows not aligned
    t = temps([0.0, 1.0, 0.0, 2.0, 0.0])
    out = sample_gumbel_argmax(x, t, seed=4)
    assert torch.equal(out, sample_gumbel_argmax(x.contiguous(), t, seed=4))
    assert out[0::2].tolist() == x[0::2].float().argmax(-1).tolist()


# ---- when the pipeline takes the fused path ------------------------------------------------------
class FakeSeq:
    def __init__(self, sp, output=()):
        self.sampling_params = sp
        self.num_inflight = 0
        self.token_ids = [1, 2, 3] + list(output)
        self.num_prompt_tokens = 3

    @property
    def num_completion_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def build(params, output=()):
    return tensors_for([FakeSeq(sp, output) for sp in params], 100, (7,), torch.device("cpu"))


@pytest.mark.parametrize("params, plain", [
    ([SamplingParams()], True),
    ([SamplingParams(temperature=0), SamplingParams(temperature=0.3), SamplingParams(temperature=1.7)], True),
    ([SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2, seed=3)], True),  # greedy: filters off
    ([SamplingParams(min_tokens=2)], True),  # 2 tokens generated already: nothing suppressed
    ([SamplingParams(), SamplingParams(top_k=5)], False),
    ([SamplingParams(top_p=0.9)], False),
    ([SamplingParams(min_p=0.1)], False),
    ([SamplingParams(), SamplingParams(seed=1)], False),
    ([SamplingParams(repetition_penalty=1.1)], False),
    ([SamplingParams(temperature=0, presence_penalty=0.5)], False),
    ([SamplingParams(frequency_penalty=-0.5)], False),
    ([SamplingParams(min_tokens=3)], False),
    ([SamplingParams(logprobs=2)], False),
    ([SamplingParams(temperature=0, logprobs=0)], False),
])
def test_plain_batches_only(params, plain):
    assert build(params, output=[4, 5]).plain is plain


def test_pipeline_uses_the_kernel_on_cuda_only(monkeypatch):
    calls = []

    def spy(*args):
        calls.append(args)
        return sample_gumbel_argmax(*args)

    monkeypatch.setattr(pipeline_mod, "sample_gumbel_argmax", spy)
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    t = build([SamplingParams(temperature=0)] * 4)
    assert sample_logits(logits, t)[0].tolist() == logits.argmax(-1).tolist()
    assert not calls  # CPU: the torch path, the reference, unchanged
    if DEV != "cuda":
        return
    seqs = [FakeSeq(SamplingParams(temperature=0 if i % 2 else 0.8)) for i in range(4)]
    plain = tensors_for(seqs, 100, (7,), torch.device(DEV))
    tokens, lp = sample_logits(logits.to(DEV), plain)
    assert len(calls) == 1 and lp is None and tokens[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    again = sample_logits(logits.to(DEV), plain)[0]  # (the plan's seed, drawn when it was built: reproducible)
    assert torch.equal(again, sample_logits(logits.to(DEV), plain)[0])
    calls.clear()
    filtered = tensors_for([FakeSeq(SamplingParams(top_k=3))] * 4, 100, (7,), torch.device(DEV))
    sample_logits(logits.to(DEV), filtered)
    assert not calls


# ---- a tensor-parallel rank's shard of the vocabulary -------------------------------------------
@pytest.mark.parametrize("V, ranks, config, dtype", [(300, 2, None, torch.float32), (256, 2, None, torch.bfloat16),
                                                     (1000, 4, {"max_chunks": 2}, torch.float32),
                                                     (768, 3, {"max_chunks": 1}, torch.bfloat16)])
def test_shards_pick_the_full_rows_token(V, ranks, config, dtype):
    """Every rank's partials of its shard, stacked, give the token the whole row gives: the same
    noise per column (shards not aligned to tiles: a tile is 128 columns on CPU), ties across the
    shard boundary to the smaller index, -inf never chosen, a row with a NaN in any shard or no
    finite logit NON_FINITE (-1)."""
    from nanoinfer.kernels.sampling import gumbel_argmax_partials, pick_token
    torch.manual_seed(V)
    shard = V // ranks
    x = torch.randn(10, V) * 2
    x[1, [shard - 1, shard]] = 9.0  # a tie across the boundary
    x[2, [V - 1, shard + 1]] = 9.0
    x[3, :shard] = float("-inf")  # a whole shard -inf
    x[4] = float("-inf")
    x[5] = float("nan")
    x[6, :shard] = float("nan")
    x[7, shard:] = 0.5  # a shard all equal
    t = temps([0.0, 0.0, 0.0, 0.8, 1.0, 0.0, 1.3, 0.0, 2.5, 0.6])
    logits = x.to(DEV, dtype)
    for seed in (7, 2**31 - 2):
        parts = [gumbel_argmax_partials(logits[:, r * shard:(r + 1) * shard].contiguous(), t, seed, r * shard,
                                        config) for r in range(ranks)]
        assert len({p.shape for p in parts}) == 1  # the same on every rank: they can be exchanged
        tokens = pick_token(torch.stack(parts), config)
        assert tokens.tolist() == sample_gumbel_argmax(logits, t, seed, config).tolist()
    greedy = pick_token(torch.stack([gumbel_argmax_partials(logits[:, r * shard:(r + 1) * shard], temps([0.0] * 10),
                                                              3, r * shard, config) for r in range(ranks)]), config)
    want = logits.float().argmax(-1).tolist()
    assert greedy.tolist() == want[:4] + [-1, -1, -1] + want[7:]


def test_shard_partials_have_one_shape_on_any_gpu(monkeypatch):
    """The ranks exchange their partials: their shape must not follow the GPU's SM count."""
    from nanoinfer.kernels import sampling
    x = torch.zeros(3, 2560, device=DEV)  # 20 tiles of 128 on CPU (of 4096 on CUDA: fewer chunks there)
    shape = sampling.gumbel_argmax_partials(x, temps([1.0] * 3), 1, 2560).shape
    monkeypatch.setattr(sampling, "_num_sms", lambda device: 7)
    assert sampling.gumbel_argmax_partials(x, temps([1.0] * 3), 1, 0).shape == shape


def test_shard_partials_of_an_empty_batch():
    from nanoinfer.kernels.sampling import gumbel_argmax_partials, pick_token
    parts = gumbel_argmax_partials(torch.zeros(0, 150, device=DEV), temps([]), 1, 150)
    assert pick_token(parts[None]).shape == (0,)


@pytest.mark.parametrize("config", [None, {"max_chunks": 1}])
def test_a_row_with_a_nan_or_inf_logit_gives_non_finite(config):
    """A NaN or +inf anywhere in a row (any chunk, greedy or sampled) gives NON_FINITE, whatever the
    other rows hold; -inf entries are fine (masked tokens), but a row of nothing else is NON_FINITE
    too, as the pipeline's torch path marks it."""
    from nanoinfer.kernels.sampling import NON_FINITE
    x = torch.randn(8, 700)
    x[1, 650] = float("nan")
    x[2, 3] = float("inf")
    x[3] = float("nan")
    x[4, :600] = float("-inf")
    x[6:] = float("-inf")
    t = temps([0.0, 1.0, 0.0, 0.7, 1.0, 0.0, 0.0, 1.0])
    tokens = sample_gumbel_argmax(x.to(DEV), t, 5, config).tolist()
    assert tokens[1] == tokens[2] == tokens[3] == tokens[6] == tokens[7] == NON_FINITE
    from nanoinfer.sampling.pipeline import mark_non_finite_rows
    assert mark_non_finite_rows(x, torch.zeros(8, dtype=torch.int64)).tolist() == \
        [0, NON_FINITE, NON_FINITE, NON_FINITE, 0, 0, NON_FINITE, NON_FINITE]
    assert tokens[0] == x[0].argmax().item() and tokens[5] == x[5].argmax().item() and tokens[4] >= 600
