"""Step latency of tensor_parallel_size=2 vs 1 on CPU with a tiny model: what the worker RPC
(shared memory + a pipe per worker; every rank is a worker process) and the gloo collectives add to
each engine step.

    python3 -m nanoinfer.bench.tp_step [--batch 1 16] [--steps 100]
"""
import argparse
import os
import pickle
import statistics
import tempfile
import time

import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.step.step_message import StepInput
from nanoinfer.utils.tiny_model import build_tiny_checkpoint


def decode_step_times(llm, batch: int, steps: int) -> tuple[list[float], int]:
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        llm.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8], params)
    times, msg_bytes = [], 0
    while not llm.is_finished():
        t = time.perf_counter()
        _, num_tokens = llm.step()
        if num_tokens < 0:  # decode
            times.append(time.perf_counter() - t)
    step = StepInput(batch, [99] * batch, [1] * batch, [1] * batch, [list(range(8))] * batch)  # decode rows at position 99
    msg_bytes = len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    return times, msg_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, help="torch threads in this process (tp=1); workers use "
                        "cores / tp")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as path:
        build_tiny_checkpoint(path)
        rows = []
        for tp in (1, 2):
            llm = LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, max_model_len=512)
            try:
                ping = None
                if tp > 1:
                    for _ in range(20):
                        llm.model_runner.ping()
                    t = []
                    for _ in range(200):
                        s = time.perf_counter()
                        llm.model_runner.ping()
                        t.append(time.perf_counter() - s)
                    ping = statistics.median(t)
                for batch in args.batch:
                    decode_step_times(llm, batch, 10)  # warm-up
                    times, msg = decode_step_times(llm, batch, args.steps)
                    rows.append((tp, batch, statistics.median(times), min(times), ping, msg))
            finally:
                llm.exit()
    print(f"tiny Qwen3 (2 layers, hidden 64), CPU float32, {args.steps} decode steps per row, "
          f"{torch.get_num_threads()} torch thread(s) on rank 0, {os.cpu_count()} cores")
    print(f"{'tp':>3} {'batch':>6} {'median step ms':>15} {'min step ms':>12} {'RPC ping ms':>12} {'decode msg B':>13}")
    for tp, batch, med, low, ping, msg in rows:
        ping_s = f"{ping * 1e3:12.3f}" if ping is not None else f"{'-':>12}"
        print(f"{tp:>3} {batch:>6} {med * 1e3:15.3f} {low * 1e3:12.3f} {ping_s} {msg if tp > 1 else '-':>13}")


if __name__ == "__main__":
    main()
