"""Attention over the paged KV cache whose result for a query token depends only on that token's
sequence, never on the step around it: how many queries the step has, whether they are decode rows
or prompt chunks, how the prompt was chunked, or whether its first blocks came from the prefix cache.

torch's attention (kernels/torch_attention.py) pads each group of sequences to its longest context
and lets SDPA reduce over the padded length, so a token's sum runs in an order that depends on its
neighbours. Here every query reduces over its keys one cache block at a time (block j holds
positions [j * block_size, (j + 1) * block_size): absolute positions, the same whatever the step),
blocks in order, with an online softmax. The products run on tiles of TILE_ROWS query rows of one
sequence (the last one padded) against one whole block: every matmul has the same shape, and a
tile's batch of such products gives each the same result whatever the batch's size. A block that
is wholly masked for a query (past its position) adds exact zeros and leaves its running maximum,
so a tile may read blocks some of its rows do not need.

On CUDA (`TritonInvariantAttentionBackend`) every step, decode included, runs the Triton prefill
kernel (kernels/triton_attention.py) with one tile config: key tiles of BLOCK_N at absolute
positions, in order, each through the same masked code path, and a decode row computed as the same
row of a prompt would be. The split-KV decode kernel, whose splits follow the batch, is not used.
"""
import torch

from nanoinfer.kernels.triton_attention import prefill_attention
from nanoinfer.layers.attention_backend import FusedEpilogueBackend, TorchAttentionBackend
from nanoinfer.utils.context import get_context

TILE_ROWS = 16
MAX_TILES = 64  # tiles computed together


def _tiles(query_lens: list[int], context_lens: list[int], block_size: int):
    """The query tiles, the ones reading the most blocks first: (sequence, first row, valid rows,
    first query position, blocks read) each."""
    tiles, start = [], 0
    for seq, (n, context) in enumerate(zip(query_lens, context_lens)):
        for first in range(0, n, TILE_ROWS):
            rows = min(TILE_ROWS, n - first)
            pos = context - n + first
            tiles.append((seq, start + first, rows, pos, (pos + rows - 1) // block_size + 1))
        start += n
    tiles.sort(key=lambda t: -t[4])
    return tiles


def paged_attention_fixed_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
                                 scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """paged_attention_torch's contract (kernels/torch_attention.py), batch-invariant. The tiles
    run MAX_TILES at a time (a tile's result does not depend on how many run with it), which bounds
    the memory of a long prompt's pass: each tile gathers its own copy of the block it reads."""
    out = torch.empty_like(q)
    tiles = _tiles(query_lens, context_lens, k_cache.shape[1])
    tables = block_tables.to(q.device).long()
    for first in range(0, len(tiles), MAX_TILES):
        _attend_tiles(out, q, k_cache, v_cache, tiles[first:first + MAX_TILES], context_lens, tables, scale,
                      k_scale, v_scale)
    return out


def _attend_tiles(out, q, k_cache, v_cache, tiles, context_lens, tables, scale, k_scale, v_scale):
    """Attention of `tiles` (sorted by blocks read, most first) into their rows of `out`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, count, dev = num_heads // num_kv_heads, len(tiles), q.device
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    offsets = torch.arange(TILE_ROWS, device=dev)
    seq = torch.tensor([t[0] for t in tiles], device=dev)
    valid = offsets[None, :] < torch.tensor([t[2] for t in tiles], device=dev)[:, None]       # [T, R]
    # padding rows repeat the tile's first row: key 0 is always theirs, so no row is all masked
    rows = torch.tensor([t[1] for t in tiles], device=dev)[:, None] + torch.where(valid, offsets, 0)
    q_pos = torch.tensor([t[3] for t in tiles], device=dev)[:, None] + torch.where(valid, offsets, 0)
    blocks_read = [t[4] for t in tiles]
    tables = tables[seq]                                                                       # [T, width]
    # GQA: a KV head's query heads become more rows of its tile, [T, Hkv, G * R, D]
    qg = q[rows].float().view(count, TILE_ROWS, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(count, num_kv_heads, group * TILE_ROWS, head_dim)
    running_max = torch.full((count, num_kv_heads, group * TILE_ROWS), float("-inf"), device=dev)
    denominator = torch.zeros_like(running_max)
    acc = torch.zeros(count, num_kv_heads, group * TILE_ROWS, head_dim, device=dev)
    context = torch.tensor(context_lens, device=dev)[seq]
    keys = torch.arange(block_size, device=dev)
    n = count  # the tiles reading block j: the first n
    for j in range(blocks_read[0]):
        while blocks_read[n - 1] <= j:
            n -= 1
        k_pos = j * block_size + keys
        written = k_pos[None, :] < context[:n, None]                                          # [n, B]
        ids = tables[:n, j]
        k, v = k_cache[ids].float(), v_cache[ids].float()                                    # [n, B, Hkv, D]
        if fp8:
            k = k * k_scale if k_scale is not None else k
            v = v * v_scale if v_scale is not None else v
        v = torch.where(written[:, :, None, None], v, 0.0)  # (slots past the context may hold NaN)
        # (contiguous operands: only the batch's size differs between calls)
        scores = torch.matmul(qg[:n], k.permute(0, 2, 3, 1).contiguous()) * scale           # [n, Hkv, G*R, B]
        allowed = (k_pos[None, None, :] <= q_pos[:n, :, None]) & written[:, None, :]          # [n, R, B]
        allowed = allowed[:, None, None].expand(n, 1, group, TILE_ROWS, block_size)
        scores = torch.where(allowed.reshape(n, 1, group * TILE_ROWS, block_size), scores, float("-inf"))
        new_max = torch.maximum(running_max[:n], scores.amax(-1))
        rescale = torch.exp(running_max[:n] - new_max)
        p = torch.exp(scores - new_max[..., None])
        denominator[:n] = denominator[:n] * rescale + p.sum(-1)
        acc[:n] = acc[:n] * rescale[..., None] + torch.matmul(p, v.permute(0, 2, 1, 3).contiguous())
        running_max[:n] = new_max
    o = (acc / denominator[..., None]).view(count, num_kv_heads, group, TILE_ROWS, head_dim)
    o = o.permute(0, 3, 1, 2, 4).reshape(count, TILE_ROWS, num_heads, head_dim)               # [T, R, H, D]
    out[rows[valid]] = o[valid].to(q.dtype)


class BatchInvariantAttentionBackend(TorchAttentionBackend):
    """The torch backend's q/k norm, RoPE and K/V store (row-wise already), and the attention above."""
    name = "batch_invariant"

    def attend(self, layer, q):
        ctx = get_context()
        query_lens = ctx.query_lens_cpu if ctx.is_prefill else [1] * q.shape[0]
        return paged_attention_fixed_blocks(q, layer.k_cache, layer.v_cache, query_lens, ctx.context_lens_cpu,
                                            ctx.block_tables, layer.scale, layer.k_scale, layer.v_scale)


def invariant_prefill_config(head_dim: int) -> dict:
    """The one tile config of every step (a GQA group a program where it fits)."""
    return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3 if head_dim <= 128 else 2,
            "pack_gqa": True, "mask_every_tile": True}


class TritonInvariantAttentionBackend(FusedEpilogueBackend):
    """The CUDA backends' fused q/k norm + RoPE + K/V store (row-wise), and the prefill kernel with
    one config for every step: one launch whatever the mix, so mixed steps replay CUDA graphs."""
    name = "batch_invariant_triton"
    mixed_step_graphs = True

    def attend(self, layer, q):
        ctx = get_context()
        # (a decode step: one query a sequence, cu_seqlens_q None)
        cu_seqlens_q, max_seqlen_q = (ctx.cu_seqlens_q, ctx.max_seqlen_q) if ctx.is_prefill else (None, 1)
        return prefill_attention(q, layer.k_cache, layer.v_cache, cu_seqlens_q, ctx.context_lens, ctx.block_tables,
                                 max_seqlen_q, layer.scale, config=invariant_prefill_config(q.shape[-1]),
                                 k_scale=layer.k_scale, v_scale=layer.v_scale)


def invariant_attention_backend(device: str):
    """The batch-invariant backend for `device` ("cuda" or "cpu")."""
    return TritonInvariantAttentionBackend() if device == "cuda" else BatchInvariantAttentionBackend()
