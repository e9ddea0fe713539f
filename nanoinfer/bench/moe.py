"""Fused MoE kernel micro-benchmark (CUDA): our Triton fused_moe against the torch path (a loop of
per-expert GEMMs, layers/fused_moe.py fused_moe_torch), one MoE layer of Qwen3-30B-A3B's shape by
default (hidden 2048, 128 experts, top-8, moe_intermediate 768), bf16, uniform random routing.

    PYTHONPATH=. python3 -m nanoinfer.bench.moe [--tokens 1 64 256 8192] [--sweep]

Decode sizes are weight-read bound: TB/s counts the bytes of the experts the step routes to (each
read once), against the copy bandwidth. Prefill is compute bound: TFLOP/s counts 2 * 3 * H * I per
(token, expert) pair, against the bf16 matmul rate. Both ceilings are measured here, as bench.py
does. Sizes <= 256 tokens are timed as CUDA-graph replays (what decode runs), prefill eagerly.
--sweep also tries other tile configs per size and prints the best (for kernels/fused_moe.py
default_config).

The two helpers below give bench.py's lower bound the bytes and FLOPs of an MoE model's step."""
import argparse
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from nanoinfer.kernels.fused_moe import default_config, fused_moe, moe_align
from nanoinfer.kernels.moe_gemv import moe_gemv, route_topk
from nanoinfer.layers.fused_moe import fused_moe_torch, select_experts
from nanoinfer.utils.ceilings import measure_ceilings


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a step of `tokens` tokens routes to, in expectation, under uniform routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens) if tokens != float("inf") else num_experts


def moe_step_costs(hf, dtype_bytes: int, tokens: int, tp_size: int = 1) -> tuple[float, float]:
    """(expert weight bytes a step of `tokens` tokens reads, expert matmul FLOPs per token) summed over
    the sparse layers, per rank (each holds 1/tp_size of every expert); (0, 0) for a dense model.
    Non-expert weights are not included; tokens=float("inf") gives every expert's bytes."""
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
    if not num_experts:
        return 0.0, 0.0
    inter = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    only = set(getattr(hf, "mlp_only_layers", None) or [])
    layers = sum(1 for i in range(hf.num_hidden_layers) if i not in only and (i + 1) % step == 0)
    expert_params = 3 * hf.hidden_size * inter
    hit = expected_experts_hit(num_experts, hf.num_experts_per_tok, tokens)
    return (layers * hit * expert_params * dtype_bytes / tp_size,
            layers * 2.0 * hf.num_experts_per_tok * expert_params / tp_size)


def time_ms(fn, graph: bool) -> float:
    fn()  # compile outside the timing (and the capture)
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, return_mode="median") if graph else do_bench(fn, return_mode="median")


def sweep_configs():
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3,)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages in ((16, 64, 256, 4, 3), (16, 128, 128, 4, 4), (16, 64, 128, 4, 4),
                                      (16, 128, 256, 8, 3), (32, 128, 128, 8, 4), (16, 32, 256, 4, 4)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def gemv_sweep_configs():
    """Tiles of the few-token kernels (kernels/moe_gemv.py), gate_up and down swept together."""
    for bn, bk, warps in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)):
        yield dict(gate_up=dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps),
                   down=dict(BLOCK_N=bn, BLOCK_K=min(bk, 256), num_warps=warps))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 8192])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate size (per rank)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help="also try other tile configs per size")
    p.add_argument("--no-torch", action="store_true", help="skip the (slow) torch loop")
    return p.parse_args(argv)


def bench(args, device, dtype=torch.bfloat16, timer=time_ms, ceilings=measure_ceilings):

    h, inter, num_experts, top_k = args.hidden, args.inter, args.experts, args.top_k
    bandwidth, flops_rate = ceilings(device)
    print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")
    print(f"shape: hidden {h}, experts {num_experts}, top-{top_k}, intermediate {inter}, {dtype}")
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, h, device=device, generator=gen).to(dtype) / h ** 0.5
    w2 = torch.randn(num_experts, h, inter, device=device, generator=gen).to(dtype) / inter ** 0.5
    expert_bytes = 3 * h * inter * w13.element_size()
    for m in args.tokens:
        x = torch.randn(m, h, device=device, generator=gen).to(dtype)
        weights, ids = select_experts(torch.randn(m, num_experts, device=device, generator=gen), top_k, True)
        hit = torch.unique(ids).numel()
        nbytes = hit * expert_bytes + 2 * m * h * x.element_size()  # experts read + x in, out
        flops = 2.0 * m * top_k * 3 * h * inter
        graph = m <= 256
        ref = fused_moe_torch(x, w13, w2, weights, ids).float()
        error = (fused_moe(x, w13, w2, weights, ids).float() - ref).norm() / ref.norm()
        if error > 1e-2:
            raise RuntimeError(f"fused_moe differs from the torch path at M={m}: relative error {error:.2e}")

        def report(name, ms):
            print(f"  {name:<44} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:6.2f} TB/s "
                  f"({100 * nbytes / ms / 1e-3 / bandwidth:5.1f} % copy)  {flops / ms / 1e9:6.1f} TFLOP/s "
                  f"({100 * flops / ms / 1e-3 / flops_rate:5.1f} % bf16)")

        print(f"M = {m} tokens: {hit} experts hit, {nbytes / 1e6:.1f} MB read, {flops / 1e9:.2f} GFLOP"
              f"{' (CUDA graph replays)' if graph else ''}")
        cfg = default_config(m, dtype)
        report(f"fused_moe {cfg}", timer(lambda: fused_moe(x, w13, w2, weights, ids), graph))
        align_ms = timer(lambda: moe_align(ids, num_experts, cfg["BLOCK_M"]), graph)
        print(f"    of which moe_align (3 kernels): {align_ms * 1e3:.1f} us")
        if m <= 16:
            logits = torch.randn(m, num_experts, device=device, generator=gen).to(dtype)
            report("few-token kernels (moe_gemv)", timer(lambda: moe_gemv(x, w13, w2, weights, ids), graph))
            report("routing + grouped path (select_experts, fused_moe)",
                   timer(lambda: fused_moe(x, w13, w2, *select_experts(logits, top_k, True)), graph))
            report("routing + few-token path (route_topk, moe_gemv)",
                   timer(lambda: moe_gemv(x, w13, w2, *route_topk(logits, top_k, True)), graph))
            if args.sweep:
                results = sorted((timer(lambda: moe_gemv(x, w13, w2, weights, ids, c), graph), i, c)
                                 for i, c in enumerate(gemv_sweep_configs()))
                for ms, _, c in results[:3]:
                    report(f"sweep {c}", ms)
        if not args.no_torch:
            report("torch loop of per-expert GEMMs (eager)",
                   timer(lambda: fused_moe_torch(x, w13, w2, weights, ids), False))
        if args.sweep:
            results = []
            for cfg in sweep_configs():
                try:
                    results.append((timer(lambda: fused_moe(x, w13, w2, weights, ids, cfg), graph), cfg))
                except Exception as e:  # a config the GPU cannot hold (shared memory): skip it
                    print(f"    {cfg}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            for ms, cfg in results[:3]:
                report(f"sweep {cfg}", ms)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nanoinfer.bench.moe needs a CUDA GPU")
    bench(args, torch.device("cuda"))


if __name__ == "__main__":
    main()
