"""The engine's host work per decode step, apart from the model's compute: the real engine
(scheduler, step encoder, runner's input preparation and sampling, output processing,
detokenization) on a tiny random model whose forward costs next to nothing, at batch 1, 8, 64 and
256 (16-token prompts, --output-len tokens each, temperature 0.6, ignore_eos, on the CPU by default).

Prints microseconds per decode-only step: schedule, encode + launch (less the compute: the forward
and the sampling pipeline, the device's work on CUDA), process (less the wait in collect()), their
sum, and the compute excluded from it. --profile BATCH runs
cProfile over that batch's run and prints its top functions.

    python -m nanoinfer.bench.host_step [--batches 1,8,64,256] [--output-len 128] [--profile 64] [--device cuda]
"""
import argparse
import cProfile
import os
import pstats
import random
import statistics
import tempfile
import time

import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.utils.tiny_model import build_tiny_checkpoint


def tiny_checkpoint() -> str:
    """A one-layer, 32-wide Qwen3 with the built-in tokenizer, built once into a cache directory."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    path = os.path.join(cache, "nanoinfer", "host-step-qwen3-v1")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:  # (atomic: a half-built one is never used)
            build_tiny_checkpoint(tmp, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  intermediate_size=32)
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
    return path


class ComputeTimer:
    """Wraps a method doing the device's work (the forward, the sampling pipeline), adding up the
    seconds it takes: on the CPU it computes in line, and it is excluded from the host's work."""

    def __init__(self, obj, name: str, total: list[float]):
        self.inner, self.total = getattr(obj, name), total
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.total[0] += time.perf_counter() - t


def run_batch(llm, timer: list[float], batch: int, output_len: int, rng: random.Random):
    """One run of `batch` requests; per decode-only step (the first two skipped): seconds of
    schedule, encode + launch less the compute, process less the wait, and the compute."""
    prompts = [[rng.randrange(3, llm.vocab_size) for _ in range(16)] for _ in range(batch)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)] * batch
    rids = llm.add_requests(prompts, params, keep_output=True)
    llm.step_log, forwards = [], []
    while not llm.is_finished():
        before = timer[0]
        llm.advance()
        forwards.append(timer[0] - before)
    for rid in rids:
        llm.pop_output(rid)
    steps, llm.step_log = llm.step_log, None
    rows = [(s.scheduled - s.start, s.launched - s.scheduled - f, s.end - s.launched - s.waited, f)
            for s, f in zip(steps, forwards) if s.num_decode == len(s.rows) == batch]
    return rows[2:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per batch (the median step of all is printed)")
    p.add_argument("--no-overlap", action="store_true", help="async_scheduling=False")
    p.add_argument("--profile", type=int, metavar="BATCH", help="cProfile one run at this batch size instead")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the device computes asynchronously, so no compute is subtracted (CUDA graphs on)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.profile:
        batches = [args.profile]
    llm = LLM(tiny_checkpoint(), device=args.device, max_num_seqs=max(batches), max_model_len=16 + args.output_len + 16,
              max_num_batched_tokens=max(4096, 32 * max(batches)), async_scheduling=not args.no_overlap,
              num_kvcache_blocks=max(batches) * (-(-(32 + args.output_len) // 16) + 1), enable_prefix_caching=True)
    timer = [0.0]  # seconds of compute so far
    if args.device == "cpu":  # (on CUDA these only launch the device's work: host work)
        ComputeTimer(llm.model_runner.sampler, "sample", timer)  # (its route runs the step's forward too)
    rng = random.Random(0)
    run_batch(llm, timer, min(batches), 8, rng)  # warm-up
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_batch(llm, timer, args.profile, args.output_len, rng)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
        return llm.exit()
    print(f"host work per decode step, us (tiny model on {args.device}, torch threads {torch.get_num_threads()}, "
          f"overlap {not args.no_overlap}, {args.output_len} tokens a request, median step of {args.repeats} runs)")
    print(f"{'batch':>6} {'schedule':>9} {'encode+launch':>14} {'process':>9} {'host total':>11} "
          f"{'(compute)':>10}")
    for batch in batches:
        rows = []
        for _ in range(args.repeats):
            rows += run_batch(llm, timer, batch, args.output_len, rng)
        # medians: a shared machine's stalls land in a few steps, not in the typical one
        sched, launch, process, forward = (statistics.median(col) * 1e6 for col in zip(*rows))
        print(f"{batch:6d} {sched:9.0f} {launch:14.0f} {process:9.0f} {sched + launch + process:11.0f} "
              f"{forward:10.0f}")
    print("encode+launch excludes the compute (the forward and the sampling pipeline: device work on CUDA; "
          "its own column); process excludes the wait in collect()")
    llm.exit()


if __name__ == "__main__":
    main()
