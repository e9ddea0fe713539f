"""All-reduce latency at decode sizes on two GPUs: what each of a tensor-parallel layer's two
all-reduces costs, replayed in a CUDA graph as decode runs. NCCL (NVLink multicast off) against
PyTorch's one-shot all-reduce through symmetric memory (peer loads over CUDA IPC buffers, no
multicast), when this PyTorch has it; then what the engine does, an all-reduce followed by the
residual add and RMSNorm: the copy into the buffer + one-shot + norm kernel, against the fused
kernel (kernels/all_reduce_norm.py) reading the partial sums where the projection wrote them.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m nanoinfer.bench.allreduce [--hidden 4096]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoinfer.engine.tp_executor import free_port
from nanoinfer.kernels.norm_act import rms_norm
from nanoinfer.layers.all_reduce import AllReduce, PartialSum, use_symmetric_memory

REPEAT = 64  # all-reduces per graph: 32 layers x 2, an 8B model's decode step


def graph_time(fn, iters: int = 20) -> float:
    """Seconds per call of fn(), captured REPEAT times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters / REPEAT


def worker(rank: int, world: int, port: int, hidden: int, batches: list[int], results):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    rows = []
    symm = None
    site = AllReduce(hidden)
    fused = use_symmetric_memory(site, max(batches), torch.bfloat16, torch.device("cuda", rank))
    try:
        import torch.distributed._symmetric_memory as symm_mem  # private PyTorch module: absent from some builds
        buf = symm_mem.empty(max(batches) * hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        symm = (symm_mem, buf)
    except Exception as e:  # older PyTorch, or no peer access
        rows.append(f"symmetric memory unavailable: {type(e).__name__}: {e}")
    for b in batches:
        x = torch.randn(b, hidden, dtype=torch.bfloat16, device="cuda")
        nccl = graph_time(lambda: dist.all_reduce(x))
        one_shot = None
        if symm is not None:
            symm_mem, buf = symm
            view = buf[:b * hidden].view(b, hidden)
            try:
                one_shot = graph_time(lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum",
                                                                                    dist.group.WORLD.group_name))
            except Exception as e:
                rows.append(f"one_shot_all_reduce failed at {b}: {type(e).__name__}: {e}")
                symm = None
        pair = None
        if fused and b <= site.buffer.shape[0]:
            weight = torch.rand(hidden, dtype=torch.bfloat16, device="cuda") + 0.5
            residual = torch.randn(b, hidden, dtype=torch.bfloat16, device="cuda")
            partial = PartialSum(site.buffer[:b], site)
            pair = (graph_time(lambda: rms_norm(site(x), weight, 1e-6, residual)),
                    graph_time(lambda: partial.reduce_norm(weight, 1e-6, residual)))
        rows.append((b, b * hidden * 2, nccl, one_shot, pair))
    if rank == 0:
        results.extend(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA devices")
    results = mp.Manager().list()
    mp.spawn(worker, args=(2, free_port(), args.hidden, args.batches, results), nprocs=2)
    print(f"all-reduce of [batch, {args.hidden}] bf16 on 2 GPUs, {REPEAT} per CUDA graph (us each)")
    print(f"{'batch':>6} {'bytes':>9} {'NCCL us':>9} {'one-shot us':>12} {'copy+one-shot+norm us':>22} "
          f"{'fused us':>9}")
    for row in results:
        if isinstance(row, str):
            print(row)
            continue
        b, nbytes, nccl, one_shot, pair = row
        shot = f"{one_shot * 1e6:12.1f}" if one_shot is not None else f"{'-':>12}"
        pair = f"{pair[0] * 1e6:22.1f} {pair[1] * 1e6:9.1f}" if pair else f"{'-':>22} {'-':>9}"
        print(f"{b:>6} {nbytes:>9} {nccl * 1e6:9.1f} {shot} {pair}")


if __name__ == "__main__":
    main()
