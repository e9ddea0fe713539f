"""Data-parallel router micro-benchmark (CPU, no model): the routing cost per request, and the
prefix-cache hit rate of prefix affinity against round robin on a workload of shared system prompts.

Each replica's prefix cache is the engine's own BlockManager, sized to hold a few of the system
prompts (a replica's KV pool is shared by many requests): a request allocates its prompt's blocks
(the hits are what the cache served), commits them and frees them. Outstanding tokens drain at a
rate that keeps the replicas about 90% busy, so the overload fallback plays its part.

    python3 -m nanoinfer.bench.router [--replicas 2 4] [--system-prompts 8] [--requests 4000]
"""
import argparse
import random
import time

from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.serve.router import PrefixAffinityRouter, RoundRobinRouter

UTILIZATION = 0.9


def make_workload(args, rng: random.Random) -> list[list[int]]:
    systems = [[rng.randrange(10, 30000) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    return [rng.choice(systems) + [rng.randrange(10, 30000) for _ in range(rng.randint(*args.user_len))]
            for _ in range(args.requests)]


def simulate(router, prompts: list[list[int]], replicas: int, args) -> dict:
    """Route every prompt; returns the prefix hit rate, requests per replica and routing time."""
    block_size = args.block_size
    managers = [BlockManager(args.cache_blocks, block_size) for _ in range(replicas)]
    params = SamplingParams(max_tokens=args.output_len)
    mean_cost = sum(map(len, prompts)) / len(prompts) + args.output_len
    drain = mean_cost / replicas / UTILIZATION  # tokens each replica works off between two arrivals
    loads, served = [0.0] * replicas, [0] * replicas
    hits = total = 0
    routing_s = 0.0
    for tokens in prompts:
        loads = [max(0.0, load - drain) for load in loads]
        t0 = time.perf_counter()
        keys = router.prefix_keys(tokens)
        r = router.choose(keys, loads)
        router.record(keys, r)
        routing_s += time.perf_counter() - t0
        seq = Sequence(tokens, params, block_size)
        if not managers[r].allocate(seq):
            raise ValueError("--cache-blocks must hold the longest prompt")
        hits += seq.num_cached_tokens
        total += len(tokens)
        managers[r].commit(seq, len(tokens))
        managers[r].free(seq)
        loads[r] += len(tokens) + args.output_len
        served[r] += 1
    return dict(hit_rate=hits / total, served=served, routing_us=routing_s / len(prompts) * 1e6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1024, help="tokens of each system prompt")
    ap.add_argument("--user-len", type=int, nargs=2, default=(32, 256), help="min and max tokens after it")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-blocks", type=int, default=None,
                    help="each replica's KV blocks (default: room for 3 system prompts and their suffixes)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cache_blocks is None:
        args.cache_blocks = 3 * (args.system_len + args.user_len[1]) // args.block_size
    prompts = make_workload(args, random.Random(args.seed))
    print(f"{args.requests} requests: {args.system_prompts} system prompts of {args.system_len} tokens + "
          f"{args.user_len[0]}-{args.user_len[1]} user tokens; block size {args.block_size}, "
          f"{args.cache_blocks} cache blocks per replica")
    print(f"{'replicas':>8}  {'router':<12} {'prefix hit rate':>15}  {'requests per replica':<28} {'routing':>10}")
    for replicas in args.replicas:
        for name, router in (("affinity", PrefixAffinityRouter(replicas, args.block_size)),
                             ("round robin", RoundRobinRouter(replicas, args.block_size))):
            r = simulate(router, prompts, replicas, args)
            print(f"{replicas:>8}  {name:<12} {r['hit_rate']:>14.1%}  {str(r['served']):<28} "
                  f"{r['routing_us']:>7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
