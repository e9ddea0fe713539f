"""Serving benchmark: drive a running `nanoinfer serve` (or any OpenAI-compatible server) with
concurrent streaming clients, and report request and token throughput, time to first token (TTFT),
time per output token (TPOT) and inter-token latency (ITL).

    python -m nanoinfer.serve.bench --url http://127.0.0.1:8000 --num-requests 256

Workloads: "random" is nano-vllm's (prompts of U[100, 1024] random token ids, U[100, 1024] output
tokens, ignore_eos); "sharegpt" draws long-tailed, log-normal prompt and output lengths resembling
ShareGPT conversations (medians ~120 and ~150 tokens, clipped to [4, 1024]), generated locally (no
dataset is read). Requests arrive all at once (--request-rate inf), or as a Poisson process at the
given rate; --max-concurrency caps how many run at once.
"""
import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np


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
    ttft: float = 0.0            # seconds from sending to the first text
    latency: float = 0.0         # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between the chunks after the first
    error: str | None = None


async def _one_request(client, model: str, prompt: list[int], max_tokens: int, temperature: float) -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
        result.latency = time.perf_counter() - start
    except Exception as e:  # report, do not stop the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(url: str, workload: Workload, model: str | None = None, request_rate: float = math.inf,
                        max_concurrency: int | None = None, temperature: float = 0.6,
                        seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send the workload's requests (Poisson arrivals at request_rate per second, or all at once);
    returns each request's result and the run's duration in seconds."""
    import openai  # the test extra: pip install openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=3600)
    if model is None:
        model = (await client.models.list()).data[0].id
    rng = np.random.default_rng(seed + 1)
    gaps = rng.exponential(1.0 / request_rate, len(workload.prompts)) if math.isfinite(request_rate) else \
        np.zeros(len(workload.prompts))
    arrivals = np.cumsum(gaps) - gaps[0]
    limit = asyncio.Semaphore(max_concurrency or len(workload.prompts))
    start = time.perf_counter()

    async def request(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))  # its arrival time
        async with limit:
            return await _one_request(client, model, workload.prompts[i], workload.output_lens[i], temperature)

    try:
        results = await asyncio.gather(*(request(i) for i in range(len(workload.prompts))))
    finally:
        await client.close()
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    ms = lambda xs, q: float(np.percentile(xs, q) * 1000) if len(xs) else float("nan")  # noqa: E731
    mean_ms = lambda xs: float(np.mean(xs) * 1000) if len(xs) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e_latency", e2e)):
        summary[f"mean_{name}_ms"] = mean_ms(xs)
        for q in (50, 90, 99):
            summary[f"p{q}_{name}_ms"] = ms(xs, q)
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
    for name, label, title in (("ttft", "TTFT", "Time to First Token"),
                               ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                               ("itl", "ITL", "Inter-token Latency"), ("e2e_latency", "E2EL", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        row(f"Mean {label} (ms):", f"{s[f'mean_{name}_ms']:.2f}")
        for q in (50, 90, 99):
            row(f"P{q} {label} (ms):", f"{s[f'p{q}_{name}_ms']:.2f}")
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


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
    p.add_argument("--vocab-size", type=int, default=10000, help="prompt token ids are drawn from [0, VOCAB_SIZE)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests running at once (default: no cap)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args(argv)
    workload = make_workload(args.num_requests, args.dataset, tuple(args.input_len), tuple(args.output_len),
                             args.vocab_size, args.seed)
    results, duration = asyncio.run(run_benchmark(args.url, workload, args.model, args.request_rate,
                                                   args.max_concurrency, args.temperature, args.seed))
    summary = summarize(results, duration)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
