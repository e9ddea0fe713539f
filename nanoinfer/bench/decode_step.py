"""Where a full-batch decode step's time goes, on every tensor-parallel rank: each rank builds its
ModelRunner (random weights), fills a decode step of BATCH sequences with contexts of U[300, 1500]
tokens, replays it (CUDA graphs, as the engine does), samples it at temperature 0.6 as the engine
would, and prints the wall time per step and its kernels from torch.profiler. bench.py's --profile
sees only the engine's process; with tensor parallelism the kernels run in the workers.

    python3 -m nanoinfer.bench.decode_step [--config 8b] [--tp 2] [--batch 256]
"""
import argparse
import os
import random
import time

import torch
import torch.multiprocessing as mp

from nanoinfer.bench.random_model import make_random_model_dir
from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.tp_executor import NO_MULTICAST, free_port
from nanoinfer.sampling.sampler import vocab_shard_sample
from nanoinfer.step.step_message import SampleInput, SamplingPlan, StepInput

STEPS = 50


def rank_main(rank: int, args, path: str, port: int):
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    config = Config(path, tensor_parallel_size=args.tp, load_format="dummy", max_num_seqs=args.batch,
                    max_model_len=4096, gpu_memory_utilization=0.85)
    runner = ModelRunner(config, rank, f"tcp://127.0.0.1:{port}")
    rng = random.Random(0)
    contexts = [rng.randint(300, 1500) for _ in range(args.batch)]
    bs = config.kvcache_block_size
    tables, used = [], 0
    for c in contexts:  # each sequence its own blocks
        n = c // bs + 1
        tables.append(list(range(used, used + n)))
        used += n
    runner.allocate_kv_cache(used)
    step = StepInput(args.batch, contexts, [1] * args.batch, [5] * args.batch, tables)
    # sampled at temperature 0.6, as the engine samples such a step (tp > 1: on every rank's shard)
    plan = SamplingPlan([0.6] * args.batch, all_greedy=False, any_greedy=False, seed=1)
    step.plain_sample = vocab_shard_sample(SampleInput(plan), args.tp > 1)

    def run(n):
        for _ in range(n):
            runner.launch(step, SampleInput(plan) if rank == 0 else None, None)
        torch.cuda.synchronize()

    run(10)
    start = time.perf_counter()
    run(STEPS)
    wall = (time.perf_counter() - start) / STEPS
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(10)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 10 / 1e3
    if rank == 0 or args.every_rank:
        print(f"--- rank {rank}/{args.tp}: {args.batch} sequences, mean context {sum(contexts) / args.batch:.0f}: "
              f"{wall * 1e3:.3f} ms a step, kernels {busy:.3f} ms a step, one-shot all-reduce "
              f"{runner.one_shot_all_reduce}\n"
              + events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60), flush=True)
    runner.exit()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="8b", help="a random model shape (nanoinfer.bench.random_model.SHAPES)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--every-rank", action="store_true", help="print every rank's table, not only rank 0's")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} CUDA device(s)")
    path = make_random_model_dir(args.config)
    mp.spawn(rank_main, args=(args, path, free_port()), nprocs=args.tp)


if __name__ == "__main__":
    main()
