"""Is a persistent decode kernel worth building? A measurement for that decision, not an engine path.

At batch 1 a decode step is a chain of short kernels: per layer four GEMVs (kernels/gemv.py, each
a programmatic dependent launch) and the attention kernels. This times the GEMV part of such a
step two ways, over the same weights (LAYERS layers of qkv, o, gate_up and down at a model shape,
distinct weights, more bytes than L2 holds), each projection's output feeding the next one's input:
- chain: one GEMV launch per projection, replayed from a CUDA graph, as the engine runs them;
- persistent: one launch whose programs stay resident and walk the projections in turn. Between
  projections they meet at a grid-wide barrier (an arrival counter); each program loads its first
  weight rows of the next projection before it waits there, since weights depend on nothing
  earlier, and prefetches a tile ahead as it goes.
It prints microseconds per layer and the weights' bytes over the time against the copy bandwidth,
and for the persistent kernel its time a projection beyond streaming the weights (barriers and
whatever it streams short of the copy bandwidth). The barrier needs every program resident at
once: a configuration with more programs an SM than its registers, threads or shared memory allow
is skipped (it would wait forever).

    PYTHONPATH=. python3 -m nanoinfer.bench.megakernel [--config 0.6b] [--layers 28] [--programs 1,2]
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.bench.random_model import SHAPES
from nanoinfer.kernels.gemv import gemv
from nanoinfer.utils.ceilings import measure_ceilings

DTYPE = torch.bfloat16
CHECK_PHASES = 8  # the two agree to bf16 rounding over a few projections (rounding drifts apart over many)


@triton.jit
def _weight_tile(w_ptr, chunk, kc, N, K, rr, rk, valid, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows chunk * ROWS.. and columns kc * BLOCK_K.. of an [N, K] weight (zeros where invalid)."""
    rows = chunk * ROWS + rr
    cols = kc * BLOCK_K + rk
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                   mask=valid & (rows[:, None] < N) & (cols[None, :] < K), other=0.0)


@triton.jit
def _persistent_chain_kernel(w_ptrs, ns, ks, act_ptr, bar_ptr, NUM_PHASES, ACT: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Every K a multiple of BLOCK_K. Phase p: y = W_p @ x, x the first K_p values of act half
    p % 2, y into half (p + 1) % 2. Each program owns a contiguous run of ROWS-row chunks of W_p.
    bar_ptr[0] counts programs done with a phase (phase p may read x once it reaches p * programs);
    bar_ptr[1] counts programs done with every phase, and the last of them zeroes both for the next
    launch."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    rr = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    for p in range(NUM_PHASES):
        # (alignment hints, as a GEMV's constant K and its weight's pointer give: 16-byte loads)
        w_ptr = tl.multiple_of(tl.load(w_ptrs + p).to(tl.pointer_type(tl.bfloat16)), 16)
        N = tl.load(ns + p)
        K = tl.multiple_of(tl.load(ks + p), BLOCK_K)
        x_ptr = act_ptr + (p % 2) * ACT
        y_ptr = act_ptr + ((p + 1) % 2) * ACT
        chunks = tl.cdiv(N, ROWS)
        per = tl.cdiv(chunks, G)
        c0 = pid * per
        n_k = tl.cdiv(K, BLOCK_K)
        n_it = tl.maximum(tl.minimum(c0 + per, chunks) - c0, 0) * n_k
        w_next = _weight_tile(w_ptr, c0, 0, N, K, rr, rk, n_it > 0, ROWS, BLOCK_K)
        if p > 0:  # wait for every program to finish phase p - 1 (x is its output)
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
            while seen < p * G:
                seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
        acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for it in range(n_it):
            w = w_next
            nxt = it + 1
            w_next = _weight_tile(w_ptr, c0 + nxt // n_k, nxt % n_k, N, K, rr, rk, nxt < n_it, ROWS, BLOCK_K)
            kc = it % n_k
            cols = kc * BLOCK_K + rk
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            rows = (c0 + it // n_k) * ROWS + rr
            last = kc == n_k - 1
            tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=(rows < N) & last)
            acc = tl.where(last, 0.0, acc)
        tl.debug_barrier()  # (every thread's stores before the arrival)
        tl.atomic_add(bar_ptr, 1, sem="release")
    tl.debug_barrier()
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel") == G - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)


class Chain:
    """LAYERS layers of a shape's four projections as [N, K] weights, and the two activation
    halves they ping-pong between."""

    def __init__(self, config: str, layers: int, device="cuda"):
        s = SHAPES[config]
        h, inter = s["hidden_size"], s["intermediate_size"]
        head_dim = s.get("head_dim", h // s["num_attention_heads"])
        q, kv = s["num_attention_heads"] * head_dim, s["num_key_value_heads"] * head_dim
        # (o reads the first q values of qkv's output, down the first `inter` of gate_up's)
        per_layer = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
        self.shapes = per_layer * layers
        gen = torch.Generator(device).manual_seed(0)
        self.weights = [torch.randn(n, k, device=device, dtype=DTYPE, generator=gen) / k ** 0.5
                        for n, k in self.shapes]
        self.act_size = max(max(n, k) for n, k in self.shapes)
        self.act = torch.zeros(2, self.act_size, device=device, dtype=DTYPE)
        self.x0 = torch.randn(self.act_size, device=device, dtype=DTYPE, generator=gen)
        self.w_ptrs = torch.tensor([w.data_ptr() for w in self.weights], device=device, dtype=torch.int64)
        self.ns = torch.tensor([n for n, _ in self.shapes], device=device, dtype=torch.int32)
        self.ks = torch.tensor([k for _, k in self.shapes], device=device, dtype=torch.int32)
        self.bar = torch.zeros(2, device=device, dtype=torch.int32)
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.weights)

    def output(self, phases: int) -> torch.Tensor:
        return self.act[phases % 2, :self.shapes[phases - 1][0]]

    def run_chain(self, phases: int):
        self.act[0].copy_(self.x0)
        for p in range(phases):
            n, k = self.shapes[p]
            gemv(self.act[p % 2, :k].view(1, k), self.weights[p], out=self.act[(p + 1) % 2, :n].view(1, n))

    def _args(self, phases: int, rows: int, block_k: int, warps: int) -> tuple[tuple, dict]:
        return ((self.w_ptrs, self.ns, self.ks, self.act, self.bar, phases),
                dict(ACT=self.act_size, ROWS=rows, BLOCK_K=block_k, num_warps=warps))

    def resident_per_sm(self, rows: int, block_k: int, warps: int) -> int:
        """How many programs of the persistent kernel an SM holds at once (1 if unknown)."""
        args, kwargs = self._args(1, rows, block_k, warps)
        try:
            kernel = _persistent_chain_kernel.warmup(*args, grid=(1,), **kwargs)
            kernel._init_handles()  # (sets n_regs)
            props = torch.cuda.get_device_properties(self.act.device)
            regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256  # allocated in units of 256 a warp
            fits = [getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
                    getattr(props, "regs_per_multiprocessor", 65536) // max(regs_per_warp * warps, 1)]
            if kernel.metadata.shared:
                fits.append(getattr(props, "shared_memory_per_multiprocessor", 227 << 10) // kernel.metadata.shared)
            return max(1, min(fits))
        except Exception:  # (Triton internals that moved): one program an SM always fits
            return 1

    def run_persistent(self, phases: int, programs: int, rows: int, block_k: int, warps: int):
        """Needs `programs` resident at once (resident_per_sm)."""
        self.act[0].copy_(self.x0)
        args, kwargs = self._args(phases, rows, block_k, warps)
        _persistent_chain_kernel[(programs,)](*args, **kwargs)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def time_graph(fn) -> float:
    """Median seconds of fn() replayed from a CUDA graph."""
    return bench_graph([fn], calls=1, replays=20) / 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="0.6b", choices=["0.6b", "8b"])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--programs", default="1,2", help="programs per SM to try")
    p.add_argument("--rows", default="4,8,16", help="weight rows per tile to try")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--block-k", type=int, default=1024)
    args = p.parse_args()
    copy_bw, _ = measure_ceilings("cuda")
    chain = Chain(args.config, args.layers)
    phases = len(chain.shapes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream_s = chain.weight_bytes / copy_bw
    print(f"{args.config}, {args.layers} layers ({phases} projections, {chain.weight_bytes / 1e6:.0f} MB of weights); "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s: streaming alone {stream_s / args.layers * 1e6:.2f} us a layer")
    chain.run_chain(CHECK_PHASES)
    ref = chain.output(CHECK_PHASES).clone()
    t = time_graph(lambda: chain.run_chain(phases))
    print(f"chain of GEMV launches: {t / args.layers * 1e6:7.2f} us a layer, {stream_s / t * 100:5.1f} % of copy")
    best = None
    for per_sm, rows, warps in itertools.product(*(map(int, v.split(",")) for v in (args.programs, args.rows,
                                                                                      args.warps))):
        fits = chain.resident_per_sm(rows, args.block_k, warps)
        if per_sm > fits:
            print(f"persistent, {per_sm} a SM, {rows:2} rows, {warps} warps: skipped, {fits} fit an SM")
            continue
        chain.run_persistent(CHECK_PHASES, per_sm * sms, rows, args.block_k, warps)
        err = relative_difference(chain.output(CHECK_PHASES), ref)
        run = lambda: chain.run_persistent(phases, per_sm * sms, rows, args.block_k, warps)  # noqa: E731
        t = time_graph(run)
        beyond_us = (t - stream_s) / phases * 1e6
        print(f"persistent, {per_sm} a SM, {rows:2} rows, {warps} warps: {t / args.layers * 1e6:7.2f} us a layer, "
              f"{stream_s / t * 100:5.1f} % of copy, {beyond_us:.2f} us a projection beyond streaming, "
              f"difference from the chain after {CHECK_PHASES} projections {err:.1e}")
        best = t if best is None else min(best, t)
    if best is not None:
        print(f"best persistent / chain: {best / time_graph(lambda: chain.run_chain(phases)):.2f}")


if __name__ == "__main__":
    main()
