"""Serving benchmark: drive a running `nanoinfer serve` (or any OpenAI-compatible server) with
concurrent streaming clients, and report request and token throughput, time to first token (TTFT),
time per output token (TPOT) and inter-token latency (ITL).

    python -m nanoinfer.serve.bench --url http://127.0.0.1:8000 --num-requests 256

Workloads: "random" is nano-vllm's (prompts of U[100, 1024] random token ids, U[100, 1024] output
tokens, ignore_eos); "sharegpt" draws long-tailed, log-normal prompt and output lengths resembling
ShareGPT conversations (medians ~120 and ~150 tokens, clipped to [4, 1024]), generated locally (no
dataset is read). Requests arrive all at once (--request-rate inf), or as a Poisson process at the
given rate; --max-concurrency caps how many run at once.

The client is spread over --client-processes processes (one asyncio loop each, requests dealt
round-robin, one shared arrival schedule), so that parsing tens of thousands of chunks a second
does not make the client the bottleneck; it prints its CPU use so that you can check.

Latencies follow vLLM's benchmark_serving: TTFT is the time to the first streamed chunk with a
choice, ITL the gap between successive such chunks, TPOT (end-to-end latency - TTFT) / (output
tokens - 1) per request. Every chunk with a choice counts, its text empty or not: the server sends
one per engine step, text "" while the detokenizer holds back an incomplete character or a special
token decodes to nothing (counting only chunks with text would merge those tokens into the next
one); a chunk carries several tokens only when the server merges what a slow reader has not taken
yet. "Output tokens per chunk" is thus ~1 unless the client or the server's event loop lags.
"""
import argparse
import asyncio
import multiprocessing as mp
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from httpx_sse import aconnect_sse


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(num_requests: int, dataset: str = "random", input_len=(100, 1024), output_len=(100, 1024),
                  vocab_size: int = 10000, seed: int = 0) -> Workload:
    """Random token-id prompts (token ids in [0, vocab_size), as nano-vllm's randint(0, 10000))."""
    rng = np.random.default_rng(seed)
    if dataset == "random":
        in_lens = rng.integers(input_len[0], input_len[1], num_requests, endpoint=True)
        out_lens = rng.integers(output_len[0], output_len[1], num_requests, endpoint=True)
    elif dataset == "sharegpt":
        in_lens = np.clip(rng.lognormal(math.log(120), 1.1, num_requests), 4, 1024).astype(int)
        out_lens = np.clip(rng.lognormal(math.log(150), 1.0, num_requests), 4, 1024).astype(int)
    else:
        raise ValueError(f"dataset must be 'random' or 'sharegpt', got {dataset!r}")
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in in_lens]
    return Workload(prompts, [int(n) for n in out_lens])


@dataclass
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0            # seconds from sending to the first chunk with a choice (the first token)
    latency: float = 0.0         # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between the chunks after the first
    chunks: int = 0              # chunks with a choice, text or not (one may carry several tokens)
    error: str | None = None


async def _one_request(client, model: str, prompt: list[int], max_tokens: int, temperature: float) -> RequestResult:
    """One streamed completion. httpx + httpx-sse + json, not the openai client: its per-chunk
    object building costs so much client CPU that at 256 streams the client would be the
    bottleneck."""
    result = RequestResult(prompt_tokens=len(prompt))
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
                stream_options={"include_usage": True}, ignore_eos=True)
    start = last = time.perf_counter()
    try:
        async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
            if source.response.status_code != 200:
                raise RuntimeError(f"HTTP {source.response.status_code}: {(await source.response.aread()).decode()}")
            async for event in source.aiter_sse():
                now = time.perf_counter()
                if event.data == "[DONE]":
                    break
                chunk = json.loads(event.data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                if chunk["choices"]:  # not the usage chunk; its text may be "" (held back)
                    if result.chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
    except Exception as e:  # report, do not stop the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(url: str, workload: Workload, model: str | None = None, request_rate: float = math.inf,
                        max_concurrency: int | None = None, temperature: float = 0.6, seed: int = 0,
                        share: tuple[int, int] = (0, 1),
                        start: float | None = None) -> tuple[list[RequestResult], float]:
    """Send the workload's requests (Poisson arrivals at request_rate per second, or all at once) from
    one event loop; returns each request's result and the run's duration in seconds. With
    share=(k, p), only requests k, k + p, ... (arrival times unchanged) and max_concurrency / p of
    them at once; `start` (a time.perf_counter() value, shared by processes) is time 0."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=httpx.Timeout(3600.0), limits=limits) as client:
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        rng = np.random.default_rng(seed + 1)
        gaps = rng.exponential(1.0 / request_rate, len(workload.prompts)) if math.isfinite(request_rate) else \
            np.zeros(len(workload.prompts))
        arrivals = np.cumsum(gaps) - gaps[0]
        mine = range(share[0], len(workload.prompts), share[1])
        limit = asyncio.Semaphore(max(1, (max_concurrency or len(workload.prompts)) // share[1]))
        start = time.perf_counter() if start is None else start

        async def request(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))  # its arrival time
            async with limit:
                return await _one_request(client, model, workload.prompts[i], workload.output_lens[i], temperature)

        results = await asyncio.gather(*(request(i) for i in mine))
    return results, time.perf_counter() - start


_barrier = None


def _set_barrier(barrier):
    global _barrier
    _barrier = barrier


def _meet(_):
    _barrier.wait(timeout=600)


def _client_process(args: tuple) -> tuple[list[RequestResult], float, float]:
    """One client process's share: (results, duration, CPU seconds)."""
    cpu = time.process_time()
    results, duration = asyncio.run(run_benchmark(*args))
    return results, duration, time.process_time() - cpu


def run_parallel(url: str, workload: Workload, model: str | None = None, request_rate: float = math.inf,
                 max_concurrency: int | None = None, temperature: float = 0.6, seed: int = 0,
                 processes: int = 1) -> tuple[list[RequestResult], float, list[float]]:
    """run_benchmark spread over `processes` client processes: the results in workload order, the
    duration, and each process's CPU seconds."""
    if model is None:
        response = httpx.get(url.rstrip("/") + "/v1/models", timeout=60)
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
    if processes == 1:
        cpu = time.process_time()
        results, duration = asyncio.run(run_benchmark(url, workload, model, request_rate, max_concurrency,
                                                      temperature, seed))
        return results, duration, [time.process_time() - cpu]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    with ctx.Pool(processes, initializer=_set_barrier, initargs=(barrier,)) as pool:
        pool.map(_meet, range(processes), chunksize=1)  # every process is up, its imports done
        start = time.perf_counter() + 0.1  # a shared time 0 (perf_counter is system-wide on Linux)
        parts = pool.map(_client_process, [(url, workload, model, request_rate, max_concurrency, temperature,
                                            seed, (k, processes), start) for k in range(processes)], chunksize=1)
    results = [None] * len(workload.prompts)
    for k, (part, _, _) in enumerate(parts):
        results[k::processes] = part
    return results, max(d for _, d, _ in parts), [c for _, _, c in parts]


def summarize(results: list[RequestResult], duration: float, client_cpu: list[float] | None = None) -> dict:
    ok = [r for r in results if r.error is None]
    ms = lambda xs, q: float(np.percentile(xs, q) * 1000) if len(xs) else float("nan")  # noqa: E731
    mean_ms = lambda xs: float(np.mean(xs) * 1000) if len(xs) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    summary = {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "tokens_per_chunk": out_tokens / chunks if chunks else float("nan"),
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e_latency", e2e)):
        summary[f"mean_{name}_ms"] = mean_ms(xs)
        for q in (50, 90, 99):
            summary[f"p{q}_{name}_ms"] = ms(xs, q)
    if client_cpu:  # the busiest client process's CPU use, in % of one core over the run
        summary["client_processes"] = len(client_cpu)
        summary["client_cpu_percent"] = 100 * max(client_cpu) / duration
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


def format_summary(s: dict) -> str:
    lines = ["============ Serving Benchmark Result ============"]
    row = lambda label, value: lines.append(f"{label:<40}{value:>10}")  # noqa: E731
    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    row("Output tokens per chunk:", f"{s['tokens_per_chunk']:.2f}")
    if "client_cpu_percent" in s:
        row(f"Client CPU, busiest of {s['client_processes']} (%):", f"{s['client_cpu_percent']:.0f}")
    for name, label, title in (("ttft", "TTFT", "Time to First Token"),
                               ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                               ("itl", "ITL", "Inter-token Latency"), ("e2e_latency", "E2EL", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        row(f"Mean {label} (ms):", f"{s[f'mean_{name}_ms']:.2f}")
        for q in (50, 90, 99):
            row(f"P{q} {label} (ms):", f"{s[f'p{q}_{name}_ms']:.2f}")
    lines.append("=" * 50)
    lines.append("ITL: gap between successive chunks; TPOT: (E2EL - TTFT) / (output tokens - 1), as vLLM's")
    if s.get("client_cpu_percent", 0) > 80:
        lines.append("warning: a client process was busy over 80 % of the run: latencies include client lag; "
                     "raise --client-processes")
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def served_vocab_size(url: str) -> int | None:
    """The vocabulary the server's model takes token ids from (its /v1/models card), if it says."""
    try:
        cards = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"]
        return int(cards[0]["vocab_size"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return None


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                   help="random: prompt lengths, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                   help="random: output lengths, uniform in [MIN, MAX]")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn from [0, VOCAB_SIZE) (default: 10000, or the served model's "
                        "vocabulary if smaller)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests running at once (default: no cap)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="client processes (one asyncio loop each)")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args(argv)
    if args.vocab_size is None:
        args.vocab_size = min(10000, served_vocab_size(args.url) or 10000)
    workload = make_workload(args.num_requests, args.dataset, tuple(args.input_len), tuple(args.output_len),
                             args.vocab_size, args.seed)
    try:
        results, duration, client_cpu = run_parallel(args.url, workload, args.model, args.request_rate,
                                                     args.max_concurrency, args.temperature, args.seed,
                                                     args.client_processes)
    except httpx.HTTPError as e:  # (the model's name could not be asked for)
        print(f"no request succeeded: the server at {args.url} did not answer ({e})", file=sys.stderr)
        return 1
    summary = summarize(results, duration, client_cpu)
    if not summary["successful_requests"]:
        print(f"no request succeeded ({summary['failed_requests']} failed)", *(f"error: {e}" for e in summary["errors"]),
              sep="\n", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
