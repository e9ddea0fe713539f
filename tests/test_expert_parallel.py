"""Expert parallelism (enable_expert_parallel / expert_parallel_size) on CPU (gloo), float32: at 2
ranks it gives tp=1's greedy tokens and HF's teacher-forced argmax, for Qwen3-MoE (with a dense layer)
and Mixtral, under forced preemption and prefix-cache hits; the per-rank load counter equals the
(token, top-k) pairs HF's routers send to each rank's experts; each rank reads only its own experts'
tensors; FP8 experts split whole; bad combinations are refused before any spawn. (The expert kernels'
skipping of another rank's pairs is tested in test_fused_moe.py.)

Each EP engine spawns two workers (seconds each on CI): one engine per architecture does every
engine-level check."""
import multiprocessing as mp
import random

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_reference import assert_greedy_matches_hf
from memory_pipe import MemoryPipe, drive_until_done
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.expert_parallel.placement import LOAD_COUNTER
from nanoinfer.layers.attention_backend import TorchAttentionBackend
from nanoinfer.layers.fused_moe import FusedMoE, fused_moe_torch, select_experts
from nanoinfer.layers.model_build import ModelBuild, TensorParallel
from nanoinfer.models.build import build_model
from nanoinfer.quant import linear_method_chooser
from nanoinfer.quant.fp8_scheme import Fp8Scheme
from nanoinfer.process import engine_process
from nanoinfer.process.messages import EngineStats, Submit, pack_command
from nanoinfer.serve.cli import build_parser
from nanoinfer.serve.metrics import ServerMetrics
from nanoinfer.utils import loader
from nanoinfer.utils.tiny_moe import build_tiny_moe_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL_POOL = dict(kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8)  # one max-length sequence
ARCHS = {"qwen3_moe": dict(num_layers=3, mlp_only_layers=(1,), num_experts=8, top_k=2),  # a dense layer too
         "mixtral": dict(arch="mixtral", num_experts=4, top_k=2, intermediate_size=48)}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    built = {}

    def make(name, **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in built:
            built[key] = build_tiny_moe_checkpoint(str(tmp_path_factory.mktemp("ep")), **{**ARCHS[name], **extra})
        return built[key]

    return make


def random_prompts(n, vocab, seed, lo=5, hi=40, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def generate(llm, prompts):
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def rank_loads(llm) -> list[int]:
    return next(m.values for m in llm.get_metrics() if m.name == f"nanoinfer:{LOAD_COUNTER}")


def hf_rank_loads(path, token_ids, ranks) -> list[int]:
    """(token, top-k) pairs HF's routers send to each rank's block of experts, over the MoE layers."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    top_k = hf.config.num_experts_per_tok
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids]), output_router_logits=True).router_logits
    loads = torch.zeros(ranks, dtype=torch.int64)
    for layer in logits:
        ids = torch.topk(torch.softmax(layer.float(), -1), top_k, -1).indices
        loads += torch.bincount((ids // (layer.shape[-1] // ranks)).flatten(), minlength=ranks)
    return loads.tolist()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_ep2_matches_tp1_and_hf_with_preemption_prefix_hits_and_counts_the_load(moe, arch, monkeypatch):
    path = moe(arch)
    ref = LLM(path, kvcache_block_size=16, max_model_len=SMALL_POOL["max_model_len"])
    vocab = ref.vocab_size
    busy = random_prompts(4, vocab, seed=1)                            # 4 x up to 5 blocks > 8 blocks
    shared = random_prompts(3, vocab, seed=2, lo=3, hi=8, shared=40)
    fresh = random_prompts(1, vocab, seed=3, lo=20, hi=21)[0]
    expected_busy, expected_shared = generate(ref, busy), generate(ref, shared)
    ref.exit()

    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **SMALL_POOL)
    try:
        assert llm.config.expert_parallel_size == 2
        assert generate(llm, busy) == expected_busy
        assert llm.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
        assert generate(llm, shared[:1]) == expected_shared[:1]        # warms the prefix cache
        outs = llm.generate(shared, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == expected_shared
        assert all(o.num_cached_tokens >= 32 for o in outs[1:]), [o.num_cached_tokens for o in outs]
        for prompt, out in zip(busy, expected_busy):
            assert_greedy_matches_hf(path, prompt, out)

        before = rank_loads(llm)
        [completion] = generate(llm, [fresh])
        loads = [b - a for a, b in zip(before, rank_loads(llm))]
        computed = fresh + completion[:-1]  # (the last token sampled is never fed back)
        print(f"{arch}: tokens routed to each rank's experts {loads}, HF's routers {hf_rank_loads(path, computed, 2)}")
        assert loads == hf_rank_loads(path, computed, 2)
        assert sum(loads) == len(computed) * 2 * 2  # top_k = 2, two MoE layers (qwen3_moe: one dense)
        if arch == "qwen3_moe":  # the server's engine process sends the counters with its stats
            assert_engine_process_sends_the_load(llm, monkeypatch, fresh)
    finally:
        llm.exit()
    assert not mp.active_children()


def assert_engine_process_sends_the_load(llm, monkeypatch, prompt):
    monkeypatch.setattr(engine_process, "COUNTERS_READ_S", 0.0)
    commands, events = MemoryPipe(), MemoryPipe()
    core = engine_process.EngineCore(llm, commands, events)
    commands.send([pack_command(Submit(1, [prompt], SamplingParams(max_tokens=3), False))])
    drive_until_done(core, llm)
    loads = [news.stats.counters for news in events.items if news.stats is not None and news.stats.counters]
    assert loads and loads[-1] == {LOAD_COUNTER: rank_loads(llm)}


def test_each_rank_reads_only_its_experts(moe, monkeypatch):
    """Rank 1 of 2 reads experts 4-7 of the checkpoint, whole, and never opens 0-3's tensors."""
    path = moe("qwen3_moe")
    read = []

    class Recording:
        def __init__(self, *args):
            self.file = safe_open(*args)

        def __enter__(self):
            self.f = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    config = Config(path, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=64)
    model = build_model(config, 1, 2, torch.device("cpu"), TorchAttentionBackend())
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts_read == {4, 5, 6, 7}
    assert sum(".experts." in n for n in read) == 2 * 4 * 3  # two MoE layers, 4 experts, 3 projections
    mlp = model.model.layers[0].mlp
    assert mlp.experts.gate_up_proj.weight.shape == (4, 2 * 32, 64)   # whole experts: I = 32
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        gate, up = (f.get_tensor(f"model.layers.0.mlp.experts.5.{p}_proj.weight") for p in ("gate", "up"))
        down = f.get_tensor("model.layers.0.mlp.experts.5.down_proj.weight")
    assert torch.equal(mlp.experts.gate_up_proj.weight[1], torch.cat([gate, up]))
    assert torch.equal(mlp.experts.down_proj.weight[1], down)


def block(num_experts, hidden, inter, tp=TensorParallel(), ep=False, fp8=None):
    choose = linear_method_chooser(fp8, {}) if fp8 is not None else ModelBuild().linear_method
    return FusedMoE(num_experts, 2, hidden, inter, True, prefix="mlp",
                    build=ModelBuild(tp, linear_method=choose, expert_parallel=ep))


def load_experts(moe_block, w13, w2):
    """The per-expert checkpoint tensors through the loaders, skipping (as the loader does) those
    another rank holds."""
    gate_up, down = moe_block.experts.gate_up_proj.weight, moe_block.experts.down_proj.weight
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        for part in (0, 1):
            if not gate_up.held_elsewhere((e, part)):
                gate_up.weight_loader(gate_up, w13[e, part * inter:(part + 1) * inter], (e, part))
        if not down.held_elsewhere(e):
            down.weight_loader(down, w2[e], e)
    for module in moe_block.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


@pytest.mark.parametrize("fp8", [None, Fp8Scheme("channel", online=True)], ids=["float32", "fp8-online"])
def test_the_ranks_partial_outputs_sum_to_one_rank(fp8):
    """Each rank's block of whole experts (FP8: quantized per output row, as on one rank) computes its
    pairs only; the two partial outputs (what the all-reduce sums) equal one rank's."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(6, 2 * 24, 32) * 0.2, torch.randn(6, 32, 24) * 0.2
    gate = torch.randn(6, 32)
    x = torch.randn(40, 32)
    whole = block(6, 32, 24, fp8=fp8)
    load_experts(whole, w13, w2)
    weights, ids = select_experts(x @ gate.T, 2, True)
    expected = fused_moe_torch(x, whole.experts.gate_up_proj.weight, whole.experts.down_proj.weight, weights, ids)
    parts = []
    for rank in (0, 1):
        ours = block(6, 32, 24, TensorParallel(rank, 2), ep=True, fp8=fp8)
        load_experts(ours, w13, w2)
        assert ours.experts.gate_up_proj.weight.shape == (3, 48, 32)
        torch.testing.assert_close(ours.experts.gate_up_proj.weight, whole.experts.gate_up_proj.weight[3 * rank:][:3],
                                   atol=0, rtol=0)
        parts.append(fused_moe_torch(x, ours.experts.gate_up_proj.weight, ours.experts.down_proj.weight, weights,
                                     ours.placement.local_ids(ids)))
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-6, rtol=1e-5)


def test_block_fp8_experts_load_whole_where_the_split_would_cut_a_scale_block():
    """16x16 scale blocks, intermediate size 24: two ranks' halves of 12 would cut a block (refused);
    expert parallel loads whole experts with their scales, as one rank holds them."""
    scheme = Fp8Scheme("block", block=(16, 16), scale_name="weight_scale_inv")
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 48, 32, generator=g).to(torch.float8_e4m3fn)
    w2 = torch.randn(4, 32, 24, generator=g).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(4, 2, 2, 2, generator=g) + 0.5, torch.rand(4, 2, 2, generator=g) + 0.5

    def load(moe_block):
        gate_up, down = moe_block.experts.gate_up_proj, moe_block.experts.down_proj
        for e in range(4):
            for part in (0, 1):
                if not gate_up.weight.held_elsewhere((e, part)):
                    gate_up.weight_loader(gate_up.weight, w13[e, part * 24:(part + 1) * 24], (e, part))
                    gate_up.weight_loader(gate_up.scale, s13[e, part], (e, part))
            if not down.weight.held_elsewhere(e):
                down.weight_loader(down.weight, w2[e], e)
                down.weight_loader(down.scale, s2[e], e)
        for module in moe_block.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        return moe_block

    whole = load(block(4, 32, 24, fp8=scheme))
    with pytest.raises(ValueError, match="splits a 16x16 FP8 scale block"):
        load(block(4, 32, 24, TensorParallel(0, 2), fp8=scheme))
    for rank in (0, 1):
        ours = load(block(4, 32, 24, TensorParallel(rank, 2), ep=True, fp8=scheme))
        for proj in ("gate_up_proj", "down_proj"):
            held = getattr(ours.experts, proj).weight
            assert held.dtype == torch.float32 and held.shape[0] == 2  # (CPU: dequantized once loaded)
            assert torch.equal(held, getattr(whole.experts, proj).weight[2 * rank:2 * rank + 2])


@pytest.mark.parametrize("options, arch, error, match", [
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), "dense", ValueError, "dense model"),
    (dict(tensor_parallel_size=2, expert_parallel_size=2), "e3", ValueError,
     r"expert_parallel_size=2 \(the tensor_parallel_size\) must divide the model's 3 experts"),
    (dict(tensor_parallel_size=2, expert_parallel_size=4), "qwen3_moe", ValueError,
     "expert_parallel_size=4 must equal tensor_parallel_size=2"),
    (dict(expert_parallel_size=2), "qwen3_moe", ValueError, "expert_parallel_size=2 must equal tensor_parallel_size=1"),
    (dict(expert_parallel_size=0), "qwen3_moe", ValueError, "expert_parallel_size must be >= 1"),
    (dict(expert_parallel_size="2"), "qwen3_moe", TypeError, "expert_parallel_size must be an int"),
    (dict(enable_expert_parallel=1), "qwen3_moe", TypeError, "enable_expert_parallel must be a bool"),
])
def test_bad_combinations_fail_before_any_spawn(moe, make_checkpoint, options, arch, error, match):
    path = make_checkpoint() if arch == "dense" else moe("qwen3_moe", num_experts=3) if arch == "e3" else moe(arch)
    with pytest.raises(error, match=match):
        LLM(path, device="cpu", **options)
    assert not mp.active_children()


def test_options_resolve_and_the_server_flags(moe):
    path = moe("qwen3_moe")
    assert Config(path, device="cpu").expert_parallel_size == 1
    assert Config(path, device="cpu", enable_expert_parallel=True).expert_parallel_size == 1  # (vLLM: a no-op)
    assert Config(path, device="cpu", tensor_parallel_size=2, expert_parallel_size=2).enable_expert_parallel
    args = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "2", "--enable-expert-parallel",
                                      "--expert-parallel-size", "2"])
    assert (args.enable_expert_parallel, args.expert_parallel_size) == (True, 2)


def test_server_metrics_count_the_load_per_rank():
    """/metrics: the engine's totals per rank (read about once a second) become counters by ep_rank."""
    metrics = ServerMetrics("m")
    for counters in ({LOAD_COUNTER: [5, 7]}, None, {LOAD_COUNTER: [9, 7]}):  # (None: a message without a read)
        metrics.engine_stats(EngineStats(counters=counters))
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples
               if s.name == f"nanoinfer:{LOAD_COUNTER}_total"]
    assert {s.labels["ep_rank"]: s.value for s in samples} == {"0": 9, "1": 7}


# ---- on two GPUs --------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_ep2_float32_matches_hf_and_counts_no_padding(moe, monkeypatch, enforce_eager):
    """float32 EP on two GPUs (decode in CUDA graphs, whose padded rows route too; the grouped and the
    few-token expert kernels) against HF teacher-forced; the load counts real tokens only."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    path = moe("qwen3_moe")
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, dtype="float32", device="cuda",
              enforce_eager=enforce_eager, kvcache_block_size=16, max_model_len=512, max_num_seqs=8)
    try:
        assert llm.model_runner.info()["cuda_graphs"] == (not enforce_eager)
        prompts = random_prompts(5, llm.vocab_size, seed=6, lo=1, hi=200)  # 5 rows: the graph of 8, padded
        outs = generate(llm, prompts)
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(path, p, o, tol=1e-3)
        computed = sum(len(p) + len(o) - 1 for p, o in zip(prompts, outs))
        assert sum(rank_loads(llm)) == computed * 2 * 2
    finally:
        llm.exit()
