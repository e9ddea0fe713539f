"""Benchmark the Triton paged-attention kernels against the device's ceilings.

    PYTHONPATH=. python3 -m nanoinfer.bench.kernels            # table with the kernels' default configs
    PYTHONPATH=. python3 -m nanoinfer.bench.kernels --sweep    # also sweep tile/warp/stage/split variants
    PYTHONPATH=. python3 -m nanoinfer.bench.kernels --ragged --heads 16 4   # one rank of an 8B model at tp=2

Copy bandwidth: a large device-to-device copy (bytes read + written). Matmul: bf16 8192^3.
Decode: bytes = K/V of every context token + q + out, over the median time (triton do_bench).
Prefill: causal FLOPs 4 * S^2 / 2 * H * D per sequence; torch SDPA (flash) on contiguous tensors.

Read the CUDA-graph timings (--graph-splits, --ragged): the engine replays decode from CUDA graphs.
Eager small decode calls are partly launch-bound (the Python wrapper and its Triton launches, one or
two, take as long as the kernel), so their eager timings vary from run to run. Decode can read a little above
the copy ceiling: its KV stream is read-only, while a copy is half writes.
"""
import argparse
import itertools
import math
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
from triton.testing import do_bench

from nanoinfer.kernels import triton_attention as ta
from nanoinfer.kernels.torch_attention import paged_attention_torch

H, KVH, D, BS = 16, 8, 128, 256
DTYPE = torch.bfloat16
DECODE_SHAPES = [(256, 1024), (64, 4096), (8, 8192)]
TARGETS = {(256, 1024): 0.85, (64, 4096): 0.85, (8, 8192): 0.60}


def bench(fn, rep=100):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")  # ms


def bench_graph(fns, calls=24, replays=15):
    """Median per-call time (ms) of fns (cycled: distinct input sets defeat L2 reuse) replayed from a
    CUDA graph, as decode runs in the engine: no launch overhead in the number."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def ceilings():
    n = 1 << 30  # 1 GiB of bf16 elements = 2 GiB per tensor
    a = torch.randn(n // 2, device="cuda", dtype=DTYPE)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    copy_bw = 2 * a.numel() * a.element_size() / (t * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=DTYPE)
    y = torch.randn(m, m, device="cuda", dtype=DTYPE)
    t = bench(lambda: x @ y)
    return copy_bw, 2 * m ** 3 / (t * 1e-3)


def decode_inputs(batch, ctx, width_tokens=None):
    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, BS, KVH, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    width = (width_tokens or ctx) // BS
    bt = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
    bt[:, :blocks_per_seq] = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    q = torch.randn(batch, H, D, device="cuda", dtype=DTYPE)
    ctx_t = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    nbytes = 2 * batch * ctx * KVH * D * 2 + 2 * q.numel() * 2
    return q, k, v, ctx_t, bt, nbytes


def ragged_decode_inputs(batch, lo, hi, width_tokens=4096):
    """A decode step as the engine sees it: context lengths U[lo, hi], the block table as wide as
    max_model_len (4096), every row padded to a graph bucket of 16 with context 0."""
    real = batch - batch % 16 if batch > 16 else batch
    lens = torch.randint(lo, hi + 1, (real,)).tolist() + [0] * (batch - real)
    width = width_tokens // BS
    need = [(c + BS - 1) // BS for c in lens]
    k = torch.randn(sum(need), BS, KVH, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    perm = torch.randperm(sum(need)).tolist()
    bt = torch.full((batch, width), -1, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = torch.tensor(perm[pos:pos + n], dtype=torch.int32)
        pos += n
    q = torch.randn(batch, H, D, device="cuda", dtype=DTYPE)
    nbytes = 2 * sum(lens) * KVH * D * 2 + 2 * q.numel() * 2
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device="cuda"), bt.cuda(), nbytes


def sweep_ragged(copy_bw):
    """Splits per (sequence, KV head) for ragged batches like bench.py's decode phases, CUDA-graph
    timed: with one split, a few waves of unequal programs leave SMs idle at the tail."""
    print(f"\n## ragged decode steps ({H} query / {KVH} KV heads, width 4096 tokens), CUDA graph: "
          "% of copy bandwidth per splits")
    for batch, lo, hi in [(256, 100, 1300), (208, 300, 1700), (144, 400, 2000), (128, 300, 1500), (96, 600, 2000),
                          (64, 300, 1500), (48, 900, 2048), (32, 900, 2048), (16, 1000, 2048)]:
        sets = [ragged_decode_inputs(batch, lo, hi) for _ in range(3)]
        orders = [torch.argsort(s[3], descending=True).int() for s in sets]  # longest first, as the engine
        nbytes = sum(s[5] for s in sets) / len(sets)
        rows = {}
        for ordered in (False, True):
            row = rows[ordered] = []
            for ns in (1, 2, 4, 8):
                fns = [lambda s=s, o=o: ta.decode_attention(s[0], s[1], s[2], s[3], s[4], D ** -0.5, num_splits=ns,
                                                            order=o if ordered else None)
                       for s, o in zip(sets, orders)]
                row.append(f"{ns}:{100 * nbytes / (bench_graph(fns) * 1e-3) / copy_bw:.0f}")
        heuristic = ta.decode_num_splits(batch, KVH, 4096 // ta.DECODE_CFG["block_n"], 132)
        print(f"  {batch} seqs, ctx U[{lo},{hi}] (heuristic {heuristic}): as given " + " ".join(rows[False])
              + " | longest first " + " ".join(rows[True]))
        del sets


def check_decode(q, k, v, ctx_t, bt, out, n=4):
    ref = paged_attention_torch(q[:n].float(), k, v, [1] * n, ctx_t[:n].tolist(), bt[:n], D ** -0.5)
    return ((out[:n].float() - ref).norm() / ref.norm()).item()


def run_decode(batch, ctx, copy_bw, config=None, num_splits=None, graph=False):
    n_sets = max(1, min(4, (1 << 30) // (batch * ctx * KVH * D * 4))) if graph else 1
    sets = [decode_inputs(batch, ctx) for _ in range(n_sets)]
    fns = [lambda s=s: ta.decode_attention(s[0], s[1], s[2], s[3], s[4], D ** -0.5, num_splits=num_splits,
                                           config=config) for s in sets]
    q, k, v, ctx_t, bt, nbytes = sets[0]
    err = check_decode(q, k, v, ctx_t, bt, fns[0]())
    t = bench_graph(fns) if graph else bench(fns[0])
    bw = nbytes / (t * 1e-3)
    return t, bw, bw / copy_bw, err


def prefill_inputs(batch=8, seqlen=2048):
    total = batch * seqlen
    nb = total // BS
    qkv = torch.randn(total, (H + 2 * KVH) * D, device="cuda", dtype=DTYPE)
    q = qkv[:, :H * D].view(total, H, D)
    k = torch.randn(nb, BS, KVH, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    bt = torch.randperm(nb, device="cuda").view(batch, seqlen // BS).int()
    cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device="cuda")
    ctx_t = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    return q, k, v, cu, ctx_t, bt


def run_prefill(inputs, config=None, batch=8, seqlen=2048):
    q, k, v, cu, ctx_t, bt = inputs
    fn = lambda: ta.prefill_attention(q, k, v, cu, ctx_t, bt, seqlen, D ** -0.5, config=config)
    out = fn()
    ref = paged_attention_torch(q[:seqlen].float(), k, v, [seqlen], [seqlen], bt[:1], D ** -0.5)
    err = ((out[:seqlen].float() - ref).norm() / ref.norm()).item()
    t = bench(fn)
    flops = batch * 4 * seqlen * seqlen / 2 * H * D
    return t, flops / (t * 1e-3), err


def run_sdpa(batch=8, seqlen=2048):
    F = torch.nn.functional
    q = torch.randn(batch, H, seqlen, D, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, KVH, seqlen, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    ke = k.repeat_interleave(H // KVH, 1).contiguous()
    ve = v.repeat_interleave(H // KVH, 1).contiguous()
    flops = batch * 4 * seqlen * seqlen / 2 * H * D
    res = {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            res["sdpa flash, enable_gqa"] = bench(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True))
        except Exception as e:  # noqa: BLE001
            print(f"sdpa enable_gqa failed: {type(e).__name__}: {str(e)[:100]}")
        res["sdpa flash, kv expanded"] = bench(lambda: F.scaled_dot_product_attention(
            q, ke, ve, is_causal=True))
    return {name: (t, flops / (t * 1e-3)) for name, t in res.items()}


def sweep_decode(copy_bw):
    print("\n## decode sweep (block_n, warps, stages, dot_min_group, programs_per_sm)")
    variants = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (128, 4, 2), (128, 4, 3),
                (128, 8, 2), (128, 8, 3), (256, 8, 2), (64, 2, 3)]
    best = {}
    for batch, ctx in DECODE_SHAPES:
        rows = []
        for bn, w, s in variants:
            for dmg in (2, 99):
                cfg = {"block_n": bn, "num_warps": w, "num_stages": s, "dot_min_group": dmg}
                try:
                    t, bw, frac, err = run_decode(batch, ctx, copy_bw, cfg)
                except Exception as e:  # noqa: BLE001
                    print(f"  {batch}x{ctx} {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append((frac, cfg))
                print(f"  {batch:4d}x{ctx:<5d} bn={bn:3d} w={w} st={s} dot={'y' if dmg == 2 else 'n'} "
                      f"{t * 1e3:8.1f} us {bw / 1e12:5.2f} TB/s {100 * frac:5.1f}% err={err:.1e}")
        rows.sort(key=lambda r: -r[0])
        top = rows[0][1]
        for pps in (1, 2, 8, 16):
            cfg = dict(top, programs_per_sm=pps)
            t, bw, frac, err = run_decode(batch, ctx, copy_bw, cfg)
            rows.append((frac, cfg))
            print(f"  {batch:4d}x{ctx:<5d} best cfg, programs_per_sm={pps:2d}: splits="
                  f"{ta.decode_num_splits(batch, KVH, ctx // 64, 132, pps)} "
                  f"{t * 1e3:8.1f} us {100 * frac:5.1f}%")
        rows.sort(key=lambda r: -r[0])
        best[(batch, ctx)] = rows[0]
        print(f"  best {batch}x{ctx}: {100 * rows[0][0]:.1f}% {rows[0][1]}")
    return best


def sweep_splits(copy_bw):
    print("\n## decode split sweep (small batches): % of copy bandwidth, rows = (block_n, warps, stages)")
    splits_list = [1, 2, 4, 8, 12, 16, 24, 32, 64]
    for batch, ctx in [(8, 8192), (1, 8192), (32, 2048), (16, 4096)]:
        q, k, v, ctx_t, bt, nbytes = decode_inputs(batch, ctx)
        print(f"  {batch}x{ctx}: heuristic splits "
              f"{ta.decode_num_splits(batch, KVH, ctx // 64, 132)}; splits {splits_list}")
        for bn, w, s in [(64, 2, 3), (64, 2, 4), (64, 4, 3), (128, 4, 3), (128, 8, 3)]:
            cfg = {"block_n": bn, "num_warps": w, "num_stages": s}
            fracs = []
            for ns in splits_list:
                fn = lambda: ta.decode_attention(q, k, v, ctx_t, bt, D ** -0.5, num_splits=ns, config=cfg)
                t = do_bench(fn, warmup=10, rep=40, return_mode="median")
                fracs.append(nbytes / (t * 1e-3) / copy_bw)
            print(f"    bn={bn:3d} w={w} st={s}: " + " ".join(f"{100 * f:5.1f}" for f in fracs))
        del q, k, v
    # a wide block table (max_model_len 32768) must not hurt: splits follow the real context
    q, k, v, ctx_t, bt, nbytes = decode_inputs(64, 4096, width_tokens=32768)
    t = bench(lambda: ta.decode_attention(q, k, v, ctx_t, bt, D ** -0.5))
    print(f"  64x4096 with width 32768 tokens (default cfg): {100 * nbytes / (t * 1e-3) / copy_bw:.1f}%")


def sweep_prefill(sdpa_best, batch=8, seqlen=2048):
    print(f"\n## prefill sweep, {batch}x{seqlen} (block_m, block_n, warps, stages, a GQA group a program)")
    inputs = prefill_inputs(batch, seqlen)
    rows = []
    for (bm, bn, w, s), pack in itertools.product(
            [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
             (64, 64, 4, 4), (64, 128, 4, 2), (128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 4), (64, 32, 4, 3),
             (128, 128, 4, 2)], (False, True)):
        cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s, "pack_gqa": pack}
        try:
            t, fl, err = run_prefill(inputs, cfg, batch, seqlen)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append((fl, cfg))
        print(f"  bm={bm:3d} bn={bn:3d} w={w} st={s} pack={int(pack)} {t * 1e3:8.1f} us {fl / 1e12:6.1f} TFLOP/s "
              f"{fl / sdpa_best:5.2f}x sdpa err={err:.1e}")
    rows.sort(key=lambda r: -r[0])
    print(f"  best: {rows[0][0] / 1e12:.1f} TFLOP/s {rows[0][1]}")
    return rows[0]


def main():
    global H, KVH
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--splits", action="store_true")
    ap.add_argument("--graph-splits", action="store_true")
    ap.add_argument("--ragged", action="store_true", help="splits sweep on engine-like ragged decode steps")
    ap.add_argument("--prefill-shape", type=int, nargs=2, default=(8, 2048), metavar=("ROWS", "LEN"),
                    help="--sweep's prefill step: ROWS prompts of LEN tokens (a multiple of 256)")
    ap.add_argument("--heads", type=int, nargs=2, default=(H, KVH), metavar=("Q", "KV"),
                    help="attention heads of the shapes (per rank: tensor parallelism divides both)")
    args = ap.parse_args()
    H, KVH = args.heads
    if args.prefill_shape[0] < 1 or args.prefill_shape[1] < BS or args.prefill_shape[1] % BS:
        ap.error(f"--prefill-shape: ROWS >= 1 and LEN a positive multiple of {BS}, got {args.prefill_shape}")
    if KVH < 1 or H % KVH:
        ap.error(f"--heads: Q must be a multiple of KV (>= 1), got {H} {KVH}")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    copy_bw, mm = ceilings()
    sdpa = run_sdpa()
    sdpa_best = max(fl for _, fl in sdpa.values())
    if args.splits:
        sweep_splits(copy_bw)
    if args.graph_splits:
        print("\n## decode splits, CUDA-graph timed, default cfg: % of copy bandwidth")
        for batch, ctx in [(8, 8192), (1, 8192), (32, 2048), (16, 4096)]:
            row = []
            for ns in (1, 2, 4, 8, 16, 32, 64):
                row.append(f"{ns}:{100 * run_decode(batch, ctx, copy_bw, num_splits=ns, graph=True)[2]:.0f}")
            print(f"  {batch}x{ctx} (heuristic {ta.decode_num_splits(batch, KVH, ctx // 64, 132)}): "
                  + " ".join(row))
    if args.ragged:
        sweep_ragged(copy_bw)
    if args.sweep:
        sweep_decode(copy_bw)
        sweep_prefill(sdpa_best, *args.prefill_shape)
    print("\n## results (defaults: decode %s, prefill %s)" % (ta.DECODE_CFG, ta.PREFILL_CFG))
    print(f"| what | time | achieved | vs ceiling | target | rel err |")
    print(f"|---|---|---|---|---|---|")
    print(f"| copy bandwidth (2 GiB d2d) | | {copy_bw / 1e12:.2f} TB/s | | | |")
    print(f"| bf16 matmul 8192^3 | | {mm / 1e12:.0f} TFLOP/s | | | |")
    for graph in (True, False):
        for batch, ctx in DECODE_SHAPES:
            t, bw, frac, err = run_decode(batch, ctx, copy_bw, graph=graph)
            splits = ta.decode_num_splits(batch, KVH, math.ceil(ctx / ta.DECODE_CFG["block_n"]), 132)
            ok = "ok" if frac >= TARGETS[(batch, ctx)] else "MISSED"
            how = "CUDA graph" if graph else "eager do_bench"
            print(f"| decode {batch}x{ctx} (splits {splits}, {how}) | {t * 1e3:.1f} us | "
                  f"{bw / 1e12:.2f} TB/s | {100 * frac:.1f}% of copy | >= {100 * TARGETS[(batch, ctx)]:.0f}% "
                  f"{ok} | {err:.1e} |")
    for name, (t, fl) in sdpa.items():
        print(f"| {name} 8x2048 | {t * 1e3:.1f} us | {fl / 1e12:.0f} TFLOP/s | "
              f"{100 * fl / mm:.0f}% of matmul | | |")
    t, fl, err = run_prefill(prefill_inputs())
    ok = "ok" if fl / sdpa_best >= 0.7 else "MISSED"
    print(f"| prefill triton 8x2048 | {t * 1e3:.1f} us | {fl / 1e12:.0f} TFLOP/s | "
          f"{fl / sdpa_best:.2f}x best sdpa | >= 0.70x {ok} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
