"""End to end on a CUDA GPU: Triton backend + CUDA graphs against HF, bf16 graphs against eager.

Engines come from conftest's shared_llm (one per configuration, shared by the tests that build the
same one) or make_llm (a test's own, for tests that read its step log or counters); both size the
KV pool to the test's needs rather than to the GPU."""
import random

import pytest
import torch

from hf_reference import assert_greedy_matches_hf
from nanoinfer import LLM, SamplingParams

pytestmark = pytest.mark.cuda

SMALL = dict(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128)  # the checkpoint most tests use


def graphs_options(block_size: int) -> dict:
    """The float32 CUDA-graph engine of test_float32_cuda_graphs_match_hf, which other tests reuse."""
    return dict(dtype="float32", kvcache_block_size=block_size, max_model_len=1024, max_num_seqs=20)


def prompts_for(vocab, n=12, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    return [shared[:rng.randrange(0, 40)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
            for _ in range(n)]


@pytest.mark.parametrize("block_size", [16, 256])
def test_float32_cuda_graphs_match_hf(make_checkpoint, shared_llm, block_size):
    path = make_checkpoint(**SMALL)
    llm = shared_llm(path, **graphs_options(block_size))
    info = llm.model_runner.info()
    assert info["backend"] in ("triton", "flash_attn") and info["cuda_graphs"]
    prompts = prompts_for(llm.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert_greedy_matches_hf(path, p, o["token_ids"], tol=1e-3)  # TF32-free fp32, GPU reduction order


@pytest.mark.parametrize("arch, enforce_eager", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_float32_batch_one_matches_hf(make_checkpoint, shared_llm, arch, enforce_eager):
    """One sequence at a time: every projection takes the GEMV kernel, with the RMSNorm and
    SiLU*mul fused into it (kernels/gemv.py); with attention biases, and MLP biases for llama."""
    path = make_checkpoint(arch=arch, **SMALL, attention_bias=True, mlp_bias=arch == "llama")
    llm = shared_llm(path, dtype="float32", kvcache_block_size=16, max_model_len=1024, max_num_seqs=4,
                     enforce_eager=enforce_eager)
    for p in prompts_for(llm.vocab_size, n=3, seed=5):
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)[0]
        assert_greedy_matches_hf(path, p, out["token_ids"], tol=1e-3)


def test_float32_preemption_and_chunked_prefill_on_gpu(make_checkpoint, shared_llm, make_llm):
    path = make_checkpoint(**SMALL)
    prompts = prompts_for(384, n=10, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    roomy = shared_llm(path, **graphs_options(16))  # every prompt prefilled at once, never preempted
    expected = [o["token_ids"] for o in roomy.generate(prompts, sp, use_tqdm=False)]
    tight = make_llm(path, dtype="float32", kvcache_block_size=16, max_model_len=384, num_kvcache_blocks=30,
                     max_num_batched_tokens=100, max_num_seqs=8)
    try:
        got = [o["token_ids"] for o in tight.generate(prompts, sp, use_tqdm=False)]
        assert tight.scheduler.num_preemptions > 0
        assert got == expected
    finally:
        tight.exit()


@pytest.mark.parametrize("overlap", [True, False])
def test_float32_mixed_batches_match_hf(make_checkpoint, make_llm, overlap):
    """Prompts arriving while others decode, with a small token budget: steps mix decode rows and
    prompt chunks (prefill kernel, replayed from the CUDA graph of their token bucket); every greedy
    token equals HF's teacher-forced argmax. (Its own engine: it counts the engine's graph replays.)"""
    path = make_checkpoint(**SMALL)
    llm = make_llm(path, dtype="float32", kvcache_block_size=16, max_model_len=1024, max_num_batched_tokens=96,
                   max_num_seqs=16, async_scheduling=overlap)
    try:
        prompts = prompts_for(llm.vocab_size, n=12, seed=3)
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        llm.step_log = []
        rids = []
        for p in prompts:  # one arrival per step
            rids.append(llm.add_request(p, sp, keep_output=True))
            llm.step()
        while not llm.is_finished():
            llm.step()
        mixed = sum(1 for r in llm.step_log if 0 < r.num_decode < len(r.rows))
        assert mixed >= 5, f"only {mixed} mixed steps"
        info = llm.model_runner.info()  # every step with prompt chunks (<= 96 tokens) replayed a graph
        assert sorted(info["mixed_graph_sizes"]) == [4, 8, 16, 32, 64, 96]
        assert info["mixed_graph_replays"] == sum(1 for r in llm.step_log if r.num_decode < len(r.rows))
        for p, rid in zip(prompts, rids):
            assert_greedy_matches_hf(path, p, llm.pop_output(rid)["token_ids"], tol=1e-3)
    finally:
        llm.exit()


@pytest.mark.slow  # two engines of its own, each capturing the default set of CUDA graphs
def test_bf16_graphs_agree_with_eager(make_checkpoint):
    path = make_checkpoint(**SMALL)
    prompts = prompts_for(384, n=16, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    results = {}
    for eager in (True, False):
        # KV pool sized from the GPU's free memory, as by default; a small share, since this module's
        # shared engines are alive too
        llm = LLM(path, dtype="bfloat16", kvcache_block_size=256, max_model_len=512, enforce_eager=eager,
                  gpu_memory_utilization=0.1)
        results[eager] = [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.exit()
    agree = sum(a == b for a, b in zip(results[True], results[False]))
    # bf16 matmuls of different batch shapes may round differently and flip a near-tie late on;
    # the first tokens must agree everywhere and most sequences entirely.
    assert all(a[:8] == b[:8] for a, b in zip(results[True], results[False]))
    assert agree >= len(prompts) * 3 // 4, f"only {agree}/{len(prompts)} sequences identical"


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_sampling_inside_the_decode_graphs_equals_sampling_after_them(make_checkpoint, make_llm, monkeypatch,
                                                                      batch):
    """A decode step at temperature alone samples in the graphs (the LM head and the fused kernel
    replayed with the step's seed and temperatures, graph_runner.sample_decode): the same tokens as
    the same engine sampling eagerly after the forward's graph, greedy and sampled rows mixed, and
    a batch between buckets (3: padded rows). A prompt of a few tokens runs as a decode step of a
    row per token (forward_inputs.py) but samples one row: not in the graphs."""
    from nanoinfer.engine.graph_runner import GraphRunner
    from nanoinfer.sampling.sampler import Sampler
    path = make_checkpoint(**SMALL)
    prompts = prompts_for(384, n=batch, seed=3)
    prompts[-1] = prompts[-1][:5]
    params = [SamplingParams(temperature=0 if i % 3 == 2 else 0.9, max_tokens=24, ignore_eos=True)
              for i in range(batch)]
    in_graph = []
    sample_decode = GraphRunner.sample_decode

    def counting(self, *args):
        out = sample_decode(self, *args)
        in_graph.append(out is not None)
        return out

    monkeypatch.setattr(GraphRunner, "sample_decode", counting)
    results = []
    for graphs in (True, False):
        if not graphs:
            monkeypatch.setattr(Sampler, "fused_in_graph", lambda *a: False)
        llm = make_llm(path, dtype="float32", kvcache_block_size=16, max_model_len=512, max_num_seqs=8, seed=7)
        try:
            results.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.exit()
    assert sum(in_graph) >= 20  # (the decode steps of the first engine)
    assert results[0] == results[1]
    assert len(set(map(tuple, results[0]))) == batch  # (sampled rows differ)


def test_bad_input_on_gpu_is_a_clear_error(make_checkpoint, shared_llm):
    llm = shared_llm(make_checkpoint(**SMALL), **graphs_options(16))
    for bad in ([1, 10**6], [], [1] * (llm.config.max_model_len + 1)):
        with pytest.raises(ValueError):
            llm.add_request(bad, SamplingParams(max_tokens=1))
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0]["token_ids"]) >= 1
    torch.cuda.synchronize()
    assert llm.is_finished()
