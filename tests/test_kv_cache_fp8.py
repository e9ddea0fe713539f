"""kv_cache_dtype="fp8": K/V stored as float8_e4m3fn (value / scale, rounded to nearest even,
saturated to +-448), read as fp8 * scale.

- the store kernels (Triton interpreter on CPU, real on GPU) write the same bytes as the torch store;
- both Triton attention kernels and the torch path read an FP8 cache as the dequantized cache;
- the engine on CPU equals HF run with K/V round-tripped through e4m3 the same way (greedy tokens,
  logprobs close), with the default scales and with checkpoint scales; with prefix caching,
  preemption and tensor parallel (gloo) too;
- the pool sizing counts one byte per element: twice the blocks of bf16 in the same memory.
"""
import os

import pytest
import torch
from safetensors.torch import save_file

from hf_reference import hf_model
from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.kv_cache import KVCache, blocks_that_fit, kv_block_bytes, kv_cache_torch_dtype
from nanoinfer.kernels.kv_store import quantize_kv, store_kvcache_torch, store_kvcache_triton
from nanoinfer.kernels.qkv_epilogue import qkv_epilogue
from nanoinfer.kernels.torch_attention import paged_attention_torch
from nanoinfer.kernels.triton_attention import decode_attention, prefill_attention
from nanoinfer.layers.attention import Attention, load_kv_scale
from nanoinfer.layers.attention_backend import (FlashAttnBackend, TritonAttentionBackend,
                                                select_attention_backend)
from nanoinfer.layers.layernorm import rms_norm
from nanoinfer.layers.rotary_embedding import RotaryEmbedding, apply_rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def e4m3_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference rounding, written independently of nanoinfer: nearest e4m3 value of x / scale
    (ties to even, saturated), times scale, in float32."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8).float() * scale


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------- rounding
def test_quantize_kv_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, -1.0625, 500.0, -1e4, 2.0 ** -10, 1.5 * 2.0 ** -10, 0.3, -0.0])
    q = quantize_kv(x, 1.0)
    assert q.dtype == FP8
    # ties go to the even mantissa; beyond 448 saturates; 2^-10 is a tie between 0 and 2^-9 -> 0
    expected = [1.0, 1.25, -1.0, 448.0, -448.0, 0.0, 2.0 ** -9, 0.3125, -0.0]
    assert q.float().tolist() == expected
    torch.testing.assert_close(quantize_kv(x * 4, 4.0).float(), q.float(), atol=0, rtol=0)


def kv_values(n: int, heads: int, dim: int, dtype, device=DEV) -> torch.Tensor:
    """Values over many binades, with ties, saturation and subnormals mixed in."""
    x = torch.randn(n, heads, dim) * torch.logspace(-4, 2.5, n * heads * dim)[torch.randperm(n * heads * dim)].view(
        n, heads, dim)
    special = torch.tensor([1.0625, 1.1875, 500.0, -1e4, 2.0 ** -10, 0.0, -0.0, 2.0 ** -8])
    x.view(-1)[:special.numel()] = special
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", [(None, None), (0.37, 2.5)])
@pytest.mark.parametrize("strided", [False, True])
def test_store_kernel_writes_the_torch_bytes(dtype, scales, strided):
    torch.manual_seed(0)
    n, heads, dim, bs, blocks = 9, 2, 16, 16, 3
    if strided:  # views into a fused qkv row
        qkv = torch.cat([kv_values(n, heads, dim, dtype), kv_values(n, heads, dim, dtype)], dim=1)
        key, value = qkv[:, :heads], qkv[:, heads:]
    else:
        key, value = kv_values(n, heads, dim, dtype), kv_values(n, heads, dim, dtype)
    k_scale, v_scale = (None if s is None else torch.tensor(s, device=DEV) for s in scales)
    slots = torch.randperm(blocks * bs, device=DEV)[:n]
    slots[::4] = -1
    caches = [torch.zeros(blocks, bs, heads, dim, dtype=FP8, device=DEV) for _ in range(4)]
    store_kvcache_triton(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    store_kvcache_torch(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(bytes_of(caches[0]), bytes_of(caches[2]))
    assert torch.equal(bytes_of(caches[1]), bytes_of(caches[3]))
    # and what the torch store wrote is the reference rounding, at each kept slot
    kept = slots >= 0
    flat_k = caches[2].view(-1, heads, dim)[slots[kept].long()].float() * (scales[0] or 1.0)
    torch.testing.assert_close(flat_k, e4m3_round_trip(key[kept], scales[0] or 1.0), atol=0, rtol=0)
    assert not bytes_of(caches[2]).view(-1, heads * dim)[
        torch.tensor([s for s in range(blocks * bs) if s not in slots.tolist()])].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
def test_qkv_epilogue_stores_fp8(dtype, norm):
    torch.manual_seed(1)
    n, heads, kv_heads, dim, bs = 7, 4, 2, 16, 16
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim) * 3).to(dtype).to(DEV)
    positions = torch.randint(0, 500, (n,), device=DEV)
    rope = RotaryEmbedding(dim, 512, 10000.0).to(DEV)
    q_w = (torch.rand(dim, device=DEV) + 0.5).to(dtype) if norm else None
    k_w = (torch.rand(dim, device=DEV) + 0.5).to(dtype) if norm else None
    k_scale, v_scale = torch.tensor(0.05, device=DEV), torch.tensor(0.02, device=DEV)
    shape = (3, bs, kv_heads, dim)
    k_cache, v_cache, k_ref, v_ref = (torch.zeros(shape, dtype=FP8, device=DEV) for _ in range(4))
    slots = torch.randperm(3 * bs, device=DEV)[:n]
    slots[1::3] = -1
    q = qkv_epilogue(qkv, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, k_cache, v_cache, slots, heads, kv_heads,
                     dim, k_scale, v_scale)
    # the unfused path: norms, RoPE, then the torch FP8 store
    qr, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    qr, k, v = qr.reshape(n, heads, dim), k.reshape(n, kv_heads, dim), v.reshape(n, kv_heads, dim)
    if norm:
        qr, k = rms_norm(qr, q_w, 1e-6), rms_norm(k, k_w, 1e-6)
    qr, k = apply_rotary(qr, positions, rope.cos_sin_cache), apply_rotary(k, positions, rope.cos_sin_cache)
    store_kvcache_torch(k, v, k_ref, v_ref, slots, k_scale, v_scale)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, qr, **tol)
    assert torch.equal(bytes_of(v_cache), bytes_of(v_ref))  # v is stored unchanged before rounding
    if dtype == torch.float32:
        assert torch.equal(bytes_of(k_cache), bytes_of(k_ref))
    else:  # k in fp16 may differ by one fp16 unit, so by one e4m3 step where that crosses a tie
        torch.testing.assert_close(k_cache.float(), k_ref.float(), atol=2.0 ** -9, rtol=0.125)


# -------------------------------------------------------------------------------- attention
def fp8_caches(num_blocks, bs, kv_heads, dim, k_scale, v_scale, device=DEV):
    k = quantize_kv(torch.randn(num_blocks, bs, kv_heads, dim, device=device) * 2, k_scale)
    v = quantize_kv(torch.randn(num_blocks, bs, kv_heads, dim, device=device), v_scale)
    return k, v


def block_tables(ctx_lens, bs, num_blocks, device=DEV):
    need = [(c + bs - 1) // bs for c in ctx_lens]
    perm = torch.randperm(num_blocks).tolist()
    bt = torch.full((len(ctx_lens), max(need)), -1, dtype=torch.int32)
    pos = 0
    for i, k in enumerate(need):
        bt[i, :k] = torch.tensor(perm[pos:pos + k], dtype=torch.int32)
        pos += k
    return bt.to(device)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def attention_case(seed, q_lens, ctx_lens, heads, kv_heads, dim, bs, dtype, ks=0.05, vs=0.02, device=DEV):
    torch.manual_seed(seed)
    num_blocks = sum((c + bs - 1) // bs for c in ctx_lens) + 2
    k8, v8 = fp8_caches(num_blocks, bs, kv_heads, dim, ks, vs, device)
    bt = block_tables(ctx_lens, bs, num_blocks, device)
    q = torch.randn(sum(q_lens), heads, dim, device=device).to(dtype)
    k_scale, v_scale = torch.tensor(ks, device=device), torch.tensor(vs, device=device)
    # the independent reference: the dequantized cache, as a float32 cache
    ref = paged_attention_torch(q.float(), k8.float() * ks, v8.float() * vs, q_lens, ctx_lens, bt, dim ** -0.5)
    return q, k8, v8, bt, k_scale, v_scale, ref


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (4, 4, 24)])
def test_torch_path_reads_fp8_as_dequantized(heads, kv_heads, dim):
    q_lens, ctx_lens = [3, 1, 5], [19, 7, 5]
    q, k8, v8, bt, k_scale, v_scale, ref = attention_case(2, q_lens, ctx_lens, heads, kv_heads, dim, 16,
                                                          torch.float32, device="cpu")
    out = paged_attention_torch(q, k8, v8, q_lens, ctx_lens, bt, dim ** -0.5, k_scale, v_scale)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    # without the scales the result is different: they are applied, not ignored
    assert rel_err(paged_attention_torch(q, k8, v8, q_lens, ctx_lens, bt, dim ** -0.5), ref) > 0.1


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 2, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_reads_fp8(heads, kv_heads, dim, dtype):
    q_lens, ctx_lens = [20, 3, 1], [20, 40, 9]  # plain prefill, a cached prefix, a decode row
    q, k8, v8, bt, k_scale, v_scale, ref = attention_case(3, q_lens, ctx_lens, heads, kv_heads, dim, 16, dtype)
    cu = torch.tensor([0, 20, 23, 24], dtype=torch.int32, device=DEV)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    out = prefill_attention(q, k8, v8, cu, ctx, bt, max(q_lens), dim ** -0.5, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (4, 4, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_reads_fp8(heads, kv_heads, dim, dtype, num_splits):
    ctx_lens = [37, 5, 64]
    q, k8, v8, bt, k_scale, v_scale, ref = attention_case(4, [1, 1, 1], ctx_lens, heads, kv_heads, dim, 16, dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    order = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    out = decode_attention(q, k8, v8, ctx, bt, dim ** -0.5, num_splits=num_splits, order=order,
                           k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


# ---------------------------------------------------------------------------------- sizing
def test_fp8_blocks_are_half_the_bytes_and_twice_as_many_fit():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)
    bf16 = kv_block_bytes(36, 256, 8, 128, torch.bfloat16)  # one rank of an 8B shape
    fp8 = kv_block_bytes(36, 256, 8, 128, FP8)
    assert bf16 == 2 * fp8 == 2 * 36 * 256 * 8 * 128 * 2
    budget = 100 * 2 ** 30 + 12345
    assert blocks_that_fit(budget, fp8) == 2 * blocks_that_fit(budget, bf16)
    assert blocks_that_fit(-5, fp8) == 0


class _FakeAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_kv_heads, self.head_dim = 2, 16
        self.k_cache = self.v_cache = torch.tensor([])


def test_kv_cache_measures_and_allocates_fp8(tiny_qwen3):
    from nanoinfer.config import Config
    model = torch.nn.ModuleList([_FakeAttention() for _ in range(2)])  # blocks of a power-of-two size
    counts = {}
    for kv_dtype, dtype in [("auto", "bfloat16"), ("fp8", "bfloat16"), ("auto", "float32"), ("fp8", "float32")]:
        # many sequences: the fixed CPU budget binds, as gpu memory does on CUDA
        config = Config(tiny_qwen3, device="cpu", dtype=dtype, kv_cache_dtype=kv_dtype, max_num_seqs=65535,
                        max_num_batched_tokens=65535, kvcache_block_size=16)
        cache = KVCache(model, config, torch.device("cpu"))
        counts[kv_dtype, dtype] = cache.measure_capacity()
        cache.allocate(4)
        assert model[0].k_cache.shape == (4, 16, 2, 16) and model[0].k_cache.dtype == cache.dtype
        assert cache.dtype == (FP8 if kv_dtype == "fp8" else config.torch_dtype)
    assert counts["fp8", "bfloat16"] == 2 * counts["auto", "bfloat16"]
    assert counts["fp8", "float32"] == counts["fp8", "bfloat16"] == 4 * counts["auto", "float32"]


# ---------------------------------------------------------------------------------- backends
def test_flash_attn_refuses_fp8_and_selection_falls_back_to_triton(monkeypatch):
    with pytest.raises(ValueError, match="flash_attn backend cannot read an FP8 KV cache"):
        FlashAttnBackend(256, "fp8")
    import nanoinfer.layers.attention_backend as backends
    monkeypatch.setattr(backends, "flash_attn_importable", lambda: True)
    assert isinstance(select_attention_backend("cuda", 256, "fp8"), TritonAttentionBackend)
    assert select_attention_backend("cpu", 256, "fp8").name == "torch"


def test_kv_scale_parameters_and_their_loader():
    attn = Attention(4, 2, 16, 0.25, RotaryEmbedding(16, 64, 10000.0), backend=TritonAttentionBackend())
    names = dict(attn.named_parameters())
    assert set(names) == {"k_scale", "v_scale"}
    assert all(p.dtype == torch.float32 and p.shape == () and p.item() == 1.0 for p in names.values())
    load_kv_scale(attn.k_scale, torch.tensor([0.5]))
    load_kv_scale(attn.v_scale, torch.tensor(0.25, dtype=torch.bfloat16))
    assert (attn.k_scale.item(), attn.v_scale.item()) == (0.5, 0.25)
    for bad, msg in [(torch.ones(2), "one value"), (torch.tensor(0.0), "positive"), (torch.tensor(-1.0), "positive"),
                     (torch.tensor(float("nan")), "finite"), (torch.tensor(float("inf")), "finite")]:
        with pytest.raises(ValueError, match=msg):
            load_kv_scale(attn.k_scale, bad)


# ---------------------------------------------------------------------------------- engine (CPU)
def attention_layers(llm):
    return [m for m in llm.model_runner.model.modules() if isinstance(m, Attention)]


def hf_fp8_kv_model(path: str, k_scale: float, v_scale: float):
    """HF's model (float32) whose attention sees K and V round-tripped through e4m3 with the scales
    (after RoPE and the k norm, which is what the cache holds)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    name = f"fp8_kv_{k_scale}_{v_scale}"

    def attend(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, e4m3_round_trip(key, k_scale), e4m3_round_trip(value, v_scale),
                                      attention_mask, **kwargs)

    AttentionInterface.register(name, attend)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()


def assert_matches_fp8_reference(model, prompts, outs, logprob_tol=2e-3, gap_tol=1e-4):
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        ref = torch.log_softmax(logits, -1)
        ours = torch.tensor(c.token_ids)
        gap = ref.max(-1).values - ref.gather(1, ours[:, None])[:, 0]
        assert (gap <= gap_tol).all(), f"not the reference's argmax at {(gap > gap_tol).nonzero().flatten().tolist()}"
        lps = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        torch.testing.assert_close(lps, ref.gather(1, ours[:, None])[:, 0], atol=logprob_tol, rtol=0)


def random_prompts(n, vocab, seed, lo=5, hi=40, shared=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("scales", [None, (0.05, 0.02)])
def test_engine_fp8_matches_rounded_reference(tiny_qwen3, scales):
    """None: the default scales (1.0); else scales set on every layer as a checkpoint would."""
    llm = LLM(tiny_qwen3, kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=128)
    try:
        layers = attention_layers(llm)
        assert layers and all(m.k_cache.dtype == FP8 and m.v_cache.dtype == FP8 for m in layers)
        ks, vs = scales or (1.0, 1.0)
        assert all(m.k_scale.item() == 1.0 and m.v_scale.item() == 1.0 for m in layers)
        for m in layers:
            m.k_scale.fill_(ks)
            m.v_scale.fill_(vs)
        prompts = random_prompts(4, llm.vocab_size, seed=3)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.exit()
    assert_matches_fp8_reference(hf_fp8_kv_model(tiny_qwen3, ks, vs), prompts, outs)
    # and the rounding matters: the float32-KV model disagrees with our logprobs somewhere
    plain = hf_model(tiny_qwen3)
    with pytest.raises(AssertionError):
        assert_matches_fp8_reference(plain, prompts, outs, logprob_tol=1e-5)


def test_checkpoint_kv_scales_load(tiny_qwen3, tmp_path):
    """A checkpoint's k_scale / v_scale tensors (compressed-tensors' `k_proj.k_scale`, the older
    `self_attn.v_scale`) load into the layers' `self_attn.attn.k_scale` / `v_scale`."""
    path = tmp_path / "with_scales"
    path.mkdir()
    for f in os.listdir(tiny_qwen3):
        os.symlink(os.path.join(tiny_qwen3, f), path / f)
    llm = LLM(str(path), kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=128)
    num_layers = len(attention_layers(llm))
    llm.exit()
    scales = {}
    for i in range(num_layers):
        scales[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.05 * (i + 1))
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02])
    save_file(scales, str(path / "kv_scales.safetensors"))
    llm = LLM(str(path), kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=128)
    try:
        got = [s.item() for m in attention_layers(llm) for s in (m.k_scale, m.v_scale)]
        assert got == pytest.approx([s for i in range(num_layers) for s in (0.05 * (i + 1), 0.02)])
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.exit()
    save_file({"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(-1.0)}, str(path / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="k_scale.*positive"):
        LLM(str(path), kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=128)


def generate_ids(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.timeout(300)
def test_fp8_with_prefix_cache_preemption_and_tensor_parallel(tiny_qwen3):
    small = dict(kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=128)
    vocab_llm = LLM(tiny_qwen3, **small)
    try:
        vocab = vocab_llm.vocab_size
        busy = random_prompts(6, vocab, seed=5, lo=30, hi=60)
        shared = random_prompts(3, vocab, seed=6, lo=3, hi=8, shared=40)
        expected_busy, expected_shared = generate_ids(vocab_llm, busy), generate_ids(vocab_llm, shared)
    finally:
        vocab_llm.exit()
    for options in (dict(num_kvcache_blocks=8), dict(num_kvcache_blocks=8, tensor_parallel_size=2)):
        llm = LLM(tiny_qwen3, **small, **options)
        try:
            assert generate_ids(llm, busy) == expected_busy
            assert llm.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
            hits = llm.scheduler.block_manager.num_hits
            assert generate_ids(llm, shared[:1]) == expected_shared[:1]  # warms the cache
            assert generate_ids(llm, shared[1:]) == expected_shared[1:]
            assert llm.scheduler.block_manager.num_hits >= hits + 4  # two shared blocks each
            bm = llm.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks
        finally:
            llm.exit()


# ---------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_store_kernels_write_the_torch_bytes(dtype):
    torch.manual_seed(7)
    n, heads, dim, bs = 300, 8, 128, 16
    key, value = kv_values(n, heads, dim, dtype, "cuda"), kv_values(n, heads, dim, dtype, "cuda")
    k_scale, v_scale = torch.tensor(0.37, device="cuda"), torch.tensor(2.5, device="cuda")
    slots = torch.randperm(32 * bs, device="cuda")[:n]
    slots[::7] = -1
    caches = [torch.zeros(32, bs, heads, dim, dtype=FP8, device="cuda") for _ in range(2)]
    store_kvcache_triton(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    kept = slots >= 0
    for cache, x, s in ((caches[0], key, 0.37), (caches[1], value, 2.5)):
        assert torch.equal(bytes_of(cache.view(-1, heads, dim)[slots[kept]]), bytes_of(quantize_kv(x[kept], s)))


@pytest.mark.cuda
def test_cuda_store_kernel_keeps_nan_nan():
    """A NaN K/V value is stored as an FP8 NaN, as torch stores it, not saturated to +-448 (GPU min /
    max return the non-NaN operand unless told to propagate): a non-finite step stays visible. (The
    interpreter's own float8 cast turns NaN into a number: a GPU test only.)"""
    device = "cuda"
    key = torch.randn(4, 2, 32, device=device)
    key[1, 0, 3] = key[2, 1, 7] = float("nan")
    value = key.clone()
    caches = [torch.zeros(4, 4, 2, 32, dtype=FP8, device=device) for _ in range(2)]
    store_kvcache_triton(key, value, caches[0], caches[1], torch.arange(4, device=device),
                         torch.tensor(0.5, device=device), torch.tensor(2.0, device=device))
    for cache in caches:
        stored = cache.view(-1, 2, 32)[:4].float()
        assert torch.equal(stored.isnan(), key.isnan()), "exactly the NaN inputs are NaN"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_qkv_epilogue_fp8(dtype):
    torch.manual_seed(8)
    n, heads, kv_heads, dim, bs = 64, 16, 8, 128, 16
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim, device="cuda") * 3).to(dtype)
    positions = torch.randint(0, 4000, (n,), device="cuda")
    rope = RotaryEmbedding(dim, 4096, 1e6).to("cuda")
    w = (torch.rand(dim, device="cuda") + 0.5).to(dtype)
    k_scale, v_scale = torch.tensor(0.05, device="cuda"), torch.tensor(0.02, device="cuda")
    shape = (8, bs, kv_heads, dim)
    k_cache, v_cache, k_ref, v_ref = (torch.zeros(shape, dtype=FP8, device="cuda") for _ in range(4))
    slots = torch.randperm(8 * bs, device="cuda")[:n]
    qkv_epilogue(qkv, positions, rope.cos_sin_cache, w, w, 1e-6, k_cache, v_cache, slots, heads, kv_heads, dim,
                 k_scale, v_scale)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k = apply_rotary(rms_norm(k.reshape(n, kv_heads, dim), w, 1e-6), positions, rope.cos_sin_cache)
    k_ref_cpu, v_ref_cpu = k_ref.cpu(), v_ref.cpu()
    store_kvcache_torch(k.cpu(), v.reshape(n, kv_heads, dim).cpu(), k_ref_cpu, v_ref_cpu, slots.cpu(),
                        k_scale.cpu(), v_scale.cpu())
    assert torch.equal(bytes_of(v_cache.cpu()), bytes_of(v_ref_cpu))
    # k: the fused norm/RoPE may differ from the unfused one by a unit of the model's dtype
    torch.testing.assert_close(k_cache.cpu().float(), k_ref_cpu.float(), atol=2.0 ** -9, rtol=0.125)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [128, 80])  # (80: padded to 128 under a mask)
def test_cuda_attention_kernels_read_fp8(dtype, dim):
    heads, kv_heads, bs = 32, 8, 16
    q_lens, ctx_lens = [300, 17, 1, 1], [300, 1200, 77, 2000]
    q, k8, v8, bt, k_scale, v_scale, ref = attention_case(9, q_lens, ctx_lens, heads, kv_heads, dim, bs, dtype,
                                                          device="cuda")
    cu = torch.tensor([0, 300, 317, 318, 319], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    tol = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[dtype]  # as for a cache in q's dtype
    out = prefill_attention(q, k8, v8, cu, ctx, bt, 300, dim ** -0.5, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out, ref) < tol
    dec_ctx = torch.tensor([77, 2000, 1, 1200], dtype=torch.int32, device="cuda")
    dec_bt = bt[[2, 3, 2, 1]]
    q1 = q[:4].contiguous()
    dec_ref = paged_attention_torch(q1.float(), k8.float() * 0.05, v8.float() * 0.02, [1] * 4, dec_ctx.tolist(),
                                    dec_bt, dim ** -0.5)
    for splits in (None, 1, 8):
        out = decode_attention(q1, k8, v8, dec_ctx, dec_bt, dim ** -0.5, num_splits=splits, k_scale=k_scale,
                               v_scale=v_scale)
        assert rel_err(out, dec_ref) < tol


@pytest.mark.cuda
def test_cuda_engine_fp8_float32_matches_rounded_reference(tiny_qwen3, make_llm):
    """float32 model, FP8 cache with non-unit scales, CUDA graphs (decode and mixed steps), chunked
    prompts: against HF with K/V rounded the same way. The GPU's reduction order can move a K/V
    value across an e4m3 rounding boundary, so the tolerances are looser than on CPU."""
    llm = make_llm(tiny_qwen3, kv_cache_dtype="fp8", dtype="float32", kvcache_block_size=16, max_model_len=256,
                   max_num_seqs=8, max_num_batched_tokens=64)
    try:
        info = llm.model_runner.info()
        assert info["backend"] == "triton" and info["cuda_graphs"]
        layers = attention_layers(llm)
        assert all(m.k_cache.dtype == FP8 for m in layers)
        with torch.no_grad():
            for m in layers:  # (the graphs read the scales' memory, so a later fill is seen)
                m.k_scale.fill_(0.05)
                m.v_scale.fill_(0.02)
        prompts = random_prompts(6, llm.vocab_size, seed=12, lo=5, hi=120)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.model_runner.info()["mixed_graph_replays"] > 0
    finally:
        llm.exit()
    assert_matches_fp8_reference(hf_fp8_kv_model(tiny_qwen3, 0.05, 0.02), prompts, outs, logprob_tol=1e-2,
                                 gap_tol=5e-3)


@pytest.mark.cuda
def test_cuda_engine_fp8_bf16_graphs_agree_with_eager(tiny_qwen3, make_llm):
    prompts = random_prompts(8, 300, seed=11)
    results = {}
    for eager in (True, False):
        llm = make_llm(tiny_qwen3, kv_cache_dtype="fp8", dtype="bfloat16", kvcache_block_size=16,
                       max_model_len=256, max_num_seqs=8, enforce_eager=eager)
        try:
            info = llm.model_runner.info()
            assert info["backend"] == "triton" and info["cuda_graphs"] == (not eager)
            assert all(m.k_cache.dtype == FP8 for m in attention_layers(llm))
            results[eager] = generate_ids(llm, prompts)
        finally:
            llm.exit()
    # bf16 steps of different batch shapes may round differently and flip a near-tie late on
    assert all(a[:8] == b[:8] for a, b in zip(results[True], results[False]))
    agree = sum(a == b for a, b in zip(results[True], results[False]))
    assert agree >= len(prompts) * 3 // 4, f"only {agree}/{len(prompts)} sequences identical"
