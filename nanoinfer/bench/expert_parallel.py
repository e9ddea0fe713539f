"""bench.py --enable-expert-parallel: what expert parallelism adds to a step, next to the TP run's
figures. In this engine's scheme (nanoinfer/expert_parallel/placement.py) nothing moves between
ranks before the experts: hidden states and routing are replicated. Dispatch is each rank's routing
bookkeeping (its local expert ids and the load counter: element-wise kernels on [M, top_k]);
combine is the MoE layer's all-reduce of the [M, H] partial outputs, the same collective tensor
parallelism runs there. After the run, every rank (spawned again, gloo on CPU, NCCL on CUDA) times
both for one MoE layer of the model's shape, eagerly, at the run's mean tokens per decode step and
per step; times the MoE layers, over the run's measured mean step time, they give the share. (Eager:
inside CUDA graphs the launches cost less, so on CUDA this bounds the share from above; the engine's
one-shot symmetric-memory all-reduce at decode sizes is faster than the plain NCCL call timed here.)
"""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoinfer.engine.tp_executor import NO_MULTICAST, free_port
from nanoinfer.expert_parallel.options import num_experts
from nanoinfer.expert_parallel.placement import LOAD_COUNTER, ExpertLoad, ExpertPlacement
from nanoinfer.layers.fused_moe import select_experts
from nanoinfer.utils.context import reset_context, set_context

REPEATS = 50


def rank_loads(llm) -> list[int]:
    """Tokens routed to each rank's experts since the engine started."""
    return next((m.values for m in llm.get_metrics() if m.name == f"nanoinfer:{LOAD_COUNTER}"), [])


def _time(fn, cuda: bool) -> float:
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPEATS


def _rank_main(rank: int, size: int, port: int, shape: tuple, token_counts: list[int], dtype, cuda: bool, out):
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=size,
                            rank=rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    hidden, experts, top_k = shape
    placement = ExpertPlacement(rank, size, experts)
    with torch.device(device):
        load = ExpertLoad(placement)
    times = {}
    for m in token_counts:
        _, ids = select_experts(torch.randn(m, experts, device=device), top_k, True)
        partial = torch.randn(m, hidden, device=device, dtype=dtype)
        set_context(slot_mapping=torch.arange(m, device=device))
        dispatch = _time(lambda: (load.count(ids), placement.local_ids(ids)), cuda)
        reset_context()
        combine = _time(lambda: dist.all_reduce(partial), cuda)
        times[m] = (dispatch, combine)
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def dispatch_combine_times(hf, size: int, token_counts: list[int], dtype, cuda: bool) -> dict:
    """{tokens: (dispatch s, combine s)} for one MoE layer of `hf`'s shape at `size` ranks (rank 0's)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    shape = (hf.hidden_size, num_experts(hf), hf.num_experts_per_tok)
    mp.start_processes(_rank_main, args=(size, free_port(), shape, token_counts, dtype, cuda, out), nprocs=size,
                       start_method="spawn")
    return out.get(timeout=60)


def num_moe_layers(hf) -> int:
    sparse = [layer for layer in range(hf.num_hidden_layers)
              if layer not in (getattr(hf, "mlp_only_layers", None) or [])
              and (layer + 1) % getattr(hf, "decoder_sparse_step", 1) == 0]
    return len(sparse)


def report(hf, size: int, loads: list[int], steps, walls: list[float], dtype, cuda: bool):
    """Print the load per rank and the dispatch/combine share of the run's decode steps and of all
    its steps. `steps`: the run's step log; `walls`: each step's wall time (s)."""
    total = sum(loads)
    if total:
        print(f"expert parallel: tokens routed to each rank's experts {loads} (summed over MoE layers), "
              f"busiest rank {max(loads) / (total / len(loads)):.2f}x the mean")
    groups = [("decode steps", [i for i, s in enumerate(steps) if s.num_decode == len(s.rows)]),
              ("all steps", list(range(len(steps))))]
    groups = [(name, idx) for name, idx in groups if idx]
    tokens = [max(1, round(sum(sum(q for q, _ in steps[i].rows) for i in idx) / len(idx))) for _, idx in groups]
    times = dispatch_combine_times(hf, size, sorted(set(tokens)), dtype, cuda)
    layers = num_moe_layers(hf)
    for (name, idx), m in zip(groups, tokens):
        dispatch, combine = times[m]
        step = sum(walls[i] for i in idx) / len(idx)
        print(f"dispatch/combine, {name} (mean {m} tokens, {step * 1e3:.2f} ms a step): {layers} MoE layers x "
              f"(dispatch {dispatch * 1e6:.1f} us + combine {combine * 1e6:.1f} us) = "
              f"{layers * (dispatch + combine) * 1e3:.2f} ms, {100 * layers * (dispatch + combine) / step:.1f}% "
              "of a step")
