"""The flash_attn attention backend on CPU, with tests/flash_attn_reference.py standing in for the
flash-attn package (FA2's signatures and semantics, in torch): its attention over the paged cache
equals the torch backend's for prefill/extend (several sequences, prefixes already in the cache,
blocks of 256 scattered over the cache) and decode; its fused q/k norm + RoPE + K/V store equals the
torch backend's unfused one; selection and capability flags; and greedy decoding through the whole
engine with it matches Hugging Face."""
import math
import sys

import pytest
import torch

import flash_attn_reference
from nanoinfer.layers import attention_backend
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.attention_backend import (FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend,
                                                select_attention_backend)
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.rotary_embedding import RotaryEmbedding
from nanoinfer.utils.context import reset_context, set_context

BLOCK = 256


@pytest.fixture
def flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_reference)
    yield flash_attn_reference
    reset_context()


def paged_layer(backend, heads, kv_heads, dim, num_blocks, g):
    layer = Attention(heads, kv_heads, dim, dim ** -0.5, RotaryEmbedding(dim, 4096, 10000.0), backend=backend)
    layer.k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    layer.v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    return layer


def scattered_tables(context_lens, g):
    """Each sequence's blocks, taken in a shuffled order from one pool (padded with -1)."""
    counts = [math.ceil(n / BLOCK) for n in context_lens]
    pool = torch.randperm(sum(counts) + 3, generator=g).tolist()
    tables, used = [], 0
    for n in counts:
        tables.append(pool[used:used + n])
        used += n
    width = max(counts)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32), sum(counts) + 3


def cumulative(lens):
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_prefill_and_extend_match_the_torch_backend(flash_attn, heads, kv_heads):
    """Fresh prompts, prompt chunks after a cached prefix, a decode row inside a prefill step, and
    sequences spanning several blocks."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim = 32
    query_lens = [40, 7, 1, 300, 256]
    context_lens = [40, 263, 530, 300, 768]  # cached prefixes: 0, 256, 529, 0, 512
    tables, num_blocks = scattered_tables(context_lens, g)
    q = torch.randn(sum(query_lens), heads, dim, generator=g)
    set_context(is_prefill=True, cu_seqlens_q=cumulative(query_lens), cu_seqlens_k=cumulative(context_lens),
                max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
                context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=tables,
                query_lens_cpu=query_lens, context_lens_cpu=context_lens)
    layer = paged_layer(FlashAttnBackend(BLOCK), heads, kv_heads, dim, num_blocks, g)
    out = layer.backend.attend(layer, q)
    expected = TorchAttentionBackend().attend(layer, q)
    assert out.shape == (sum(query_lens), heads, dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 1)])
def test_decode_matches_the_torch_backend(flash_attn, heads, kv_heads):
    g = torch.Generator().manual_seed(heads + kv_heads)
    dim = 32
    context_lens = [1, 255, 256, 257, 700]
    tables, num_blocks = scattered_tables(context_lens, g)
    q = torch.randn(len(context_lens), heads, dim, generator=g)
    set_context(is_prefill=False, context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=tables,
                context_lens_cpu=context_lens)
    layer = paged_layer(FlashAttnBackend(BLOCK), heads, kv_heads, dim, num_blocks, g)
    out = layer.backend.attend(layer, q)
    torch.testing.assert_close(out, TorchAttentionBackend().attend(layer, q), atol=1e-5, rtol=1e-5)


def test_reference_causal_mask_is_bottom_right_aligned():
    """FA2's documented example: seqlen_q = 2 over seqlen_k = 5 keeps keys 0-3, then 0-4; with more
    queries than keys, the rows that see no key are zeros."""
    q = torch.randn(2, 1, 4)
    k, v = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    out = flash_attn_reference._attention(q, k, v, 1.0, causal=True)
    for row, seen in ((0, 4), (1, 5)):
        weights = (q[row, 0] @ k[:seen, 0].T).softmax(-1)
        torch.testing.assert_close(out[row, 0], weights @ v[:seen, 0])
    few_keys = flash_attn_reference._attention(torch.randn(5, 1, 4), k[:2], v[:2], 1.0, causal=True)
    assert torch.equal(few_keys[:3], torch.zeros(3, 1, 4)) and few_keys[3:].abs().sum() > 0


def test_fused_write_step_matches_the_torch_backend(flash_attn):
    """q/k norm + RoPE + K/V store: the Triton kernel (under the interpreter here) against the torch
    backend's unfused path; padded rows (slot -1) store nothing."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, n = 4, 2, 32, 12
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.randint(0, 900, (n,), generator=g)
    slots = torch.randperm(2 * BLOCK, generator=g)[:n]
    slots[::5] = -1
    set_context(is_prefill=True, slot_mapping=slots)
    norms = [RMSNorm(dim, 1e-6) for _ in range(2)]
    for norm in norms:
        norm.weight.data = torch.rand(dim, generator=g) + 0.5
    results = []
    for backend in (FlashAttnBackend(BLOCK), TorchAttentionBackend()):
        layer = Attention(heads, kv_heads, dim, dim ** -0.5, RotaryEmbedding(dim, 1024, 10000.0), backend=backend)
        layer.k_cache, layer.v_cache = torch.zeros(2, BLOCK, kv_heads, dim), torch.zeros(2, BLOCK, kv_heads, dim)
        results.append((backend.write_step(layer, qkv, positions, *norms), layer.k_cache, layer.v_cache))
    for fused, unfused in zip(*results):
        torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)


def test_selection_and_capability_flags(flash_attn, monkeypatch):
    assert isinstance(select_attention_backend("cpu", 16), TorchAttentionBackend)
    chosen = select_attention_backend("cuda", 512)
    assert isinstance(chosen, FlashAttnBackend) and chosen.name == "flash_attn"
    with pytest.raises(ValueError, match="kvcache_block_size % 256 == 0, got 16"):
        select_attention_backend("cuda", 16)
    flags = {b.name: (b.mixed_step_graphs, b.sorts_decode_rows)
             for b in (TorchAttentionBackend(), TritonAttentionBackend(), FlashAttnBackend(BLOCK))}
    assert flags == {"torch": (False, False), "triton": (True, True), "flash_attn": (False, False)}
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable
    assert not attention_backend.flash_attn_importable()
    assert select_attention_backend("cuda", 16).name == "triton"


def test_greedy_through_the_flash_attn_backend_matches_hf(flash_attn, make_checkpoint, monkeypatch):
    """The engine on CPU with its backend swapped for flash_attn (the runner's choice, patched: CPU
    never selects it): prompts over several blocks, chunked so later chunks attend to a cached
    prefix, next to running sequences."""
    from hf_reference import assert_greedy_matches_hf
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.models import build
    monkeypatch.setattr(build, "select_attention_backend",
                        lambda device, block_size, kv_cache_dtype="auto": FlashAttnBackend(block_size, kv_cache_dtype))
    path = make_checkpoint()
    llm = LLM(path, device="cpu", kvcache_block_size=BLOCK, max_model_len=512, max_num_batched_tokens=128)
    try:
        assert llm.model_runner.info()["backend"] == "flash_attn"
        prompts = [[(i * 37) % llm.vocab_size for i in range(1, 271)], [5, 6, 7]]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert_greedy_matches_hf(path, prompt, out["token_ids"])
    finally:
        llm.exit()
