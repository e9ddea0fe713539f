"""A stand-in for the `flash_attn` package (FA2) in torch, for testing our flash_attn backend where
flash-attn is not installed: the two functions the backend calls, with FA2's signatures and semantics
as its docstrings state them, written independently of our attention code.

- GQA/MQA: query head h attends KV head h // (nheads / nheads_k).
- causal=True aligns the mask to the bottom right: with seqlen_q query rows over seqlen_k keys,
  row i sees keys j <= i + seqlen_k - seqlen_q; a row that sees no key outputs zeros.
- A paged K/V cache is [num_blocks, page_block_size, nheads_k, headdim], sequence b's key t at
  k_cache[block_table[b, t // page_block_size], t % page_block_size]; page_block_size % 256 == 0.
- cu_seqlens, cache_seqlens and block_table are int32, as FA2 requires.

Options the backend never passes (dropout, windows, softcap, ALiBi, new k/v, rotary, ...) are
refused rather than ignored."""
import math

import torch

__version__ = "2.reference"


def _check_int32(**tensors):
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")


def _check_paged(k_cache: torch.Tensor, block_table: torch.Tensor | None):
    if block_table is not None and k_cache.shape[1] % 256:
        raise ValueError(f"paged KV cache block size must be divisible by 256, got {k_cache.shape[1]}")


def _keys(cache: torch.Tensor, b: int, start: int, length: int, block_table: torch.Tensor | None) -> torch.Tensor:
    """Sequence b's keys (or values) [length, nheads_k, headdim]: paged through block_table, else
    rows start:start+length of a flat [total, nheads_k, headdim] (varlen) or of cache[b]."""
    if block_table is None:
        return cache[start:start + length] if cache.dim() == 3 else cache[b, :length]
    page = cache.shape[1]
    blocks = block_table[b, :math.ceil(length / page)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [seqlen_q, nheads, d], k/v [seqlen_k, nheads_k, d] -> [seqlen_q, nheads, d], in float32."""
    seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[0], k.shape[1]
    if nheads % nheads_k:
        raise ValueError(f"nheads {nheads} must be divisible by nheads_k {nheads_k}")
    group = nheads // nheads_k
    scores = torch.einsum("qhgd,khd->hgqk", q.float().view(seqlen_q, nheads_k, group, d), k.float()) * scale
    if causal:
        rows = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
        scores = scores.masked_fill(torch.arange(seqlen_k)[None, :] > rows, float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # a row without keys: zeros
    return torch.einsum("hgqk,khd->qhgd", probs, v.float()).reshape(seqlen_q, nheads, d).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [total_q, nheads, d]; k, v [total_k, nheads_k, d], or paged caches with block_table.
    Returns out [total_q, nheads, d]."""
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("the reference implements no dropout, window, softcap, ALiBi or probs")
    _check_int32(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
    _check_paged(k, block_table)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if len_q > max_seqlen_q or len_k > max_seqlen_k:
            raise ValueError(f"sequence {b}: lengths ({len_q}, {len_k}) exceed max_seqlen ({max_seqlen_q}, "
                             f"{max_seqlen_k})")
        keys = _keys(k, b, cu_k[b], len_k, block_table)
        values = _keys(v, b, cu_k[b], len_k, block_table)
        out[cu_q[b]:cu_q[b + 1]] = _attention(q[cu_q[b]:cu_q[b + 1]], keys, values, scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q [batch, seqlen_q, nheads, d]; k_cache, v_cache [batch_cache, seqlen_cache, nheads_k, d], or
    paged with block_table; cache_seqlens: int or [batch] int32 keys per sequence. Returns out
    [batch, seqlen_q, nheads, d]."""
    unsupported = (k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes)
    if any(x is not None for x in unsupported) or tuple(window_size) != (-1, -1) or softcap or return_softmax_lse:
        raise NotImplementedError("the reference reads the cache only: no new k/v, rotary, windows, ...")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous last dimension")
    batch = q.shape[0]
    if cache_seqlens is None:
        lengths = [k_cache.shape[1]] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        _check_int32(cache_seqlens=cache_seqlens)
        lengths = cache_seqlens.tolist()
    _check_int32(block_table=block_table)
    _check_paged(k_cache, block_table)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b in range(batch):
        keys = _keys(k_cache, b, 0, lengths[b], block_table)
        values = _keys(v_cache, b, 0, lengths[b], block_table)
        out[b] = _attention(q[b], keys, values, scale, causal)
    return out
