"""Throughput benchmark, nano-vllm's workload by default: 256 sequences, prompts of U[100, 1024] random
token ids, outputs of U[100, 1024] tokens (ignore_eos), temperature 0.6, max_model_len 4096, seed 0.

Without --model the model is Qwen3-0.6B-shaped (or 8B with --config 8b) with random weights: throughput
does not depend on the weights, and nothing is downloaded. On CUDA it also prints the run's lower bound:
sum over steps of (weight bytes + KV bytes read) / copy bandwidth + prefill FLOPs / bf16 matmul rate,
both ceilings measured in this process, and the per-step CPU time against the step time.

On CPU, a run that ends in seconds: --config builtin-tiny (the built-in tiny checkpoint of example.py,
a 384-token vocabulary; `--config tiny` keeps Qwen3's full vocabulary), e.g.
    python bench.py --config builtin-tiny --num-seqs 16 --min-input-len 32 --max-input-len 128 \\
        --min-output-len 32 --max-output-len 64

Expert parallelism (MoE shapes: --config 30b-a3b, or builtin-tiny-moe on a CPU) adds the tokens
routed to each rank and the dispatch/combine share of a step (nanoinfer/bench/expert_parallel.py):
    python bench.py --config builtin-tiny-moe -tp 2 --enable-expert-parallel --num-seqs 8 \\
        --min-input-len 16 --max-input-len 64 --min-output-len 8 --max-output-len 16"""
import argparse
import random
import time
from random import Random, randint, seed

import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.bench.random_model import SHAPES, make_random_model_dir
from nanoinfer.utils.ceilings import measure_ceilings
from nanoinfer.utils.tiny_model import default_tiny_model_dir
from nanoinfer.utils.tiny_moe import default_tiny_moe_dir

BUILTIN_TINY = "builtin-tiny"  # --config: the built-in tiny checkpoint (its own weights), not a SHAPES entry
BUILTIN_TINY_MOE = "builtin-tiny-moe"  # the same for the built-in tiny Qwen3-MoE (utils/tiny_moe.py)


class Profiler:
    """Profile the given windows of steps with torch.profiler; print where device and host time go."""

    def __init__(self, llm: LLM, windows: list[range]):
        self.llm, self.windows, self.profiler = llm, windows, None

    def __call__(self):
        step = len(self.llm.step_log)
        window = next((w for w in self.windows if step in (w.start, w.stop)), None)
        if window is None:
            return
        if step == window.start and self.profiler is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=acts)
            self.profiler.__enter__()
        elif step == window.stop and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            table = self.profiler.key_averages()
            sizes = sorted({len(r.rows) for r in self.llm.step_log[window.start:window.stop]})
            print(f"--- profile of steps {window.start}..{window.stop - 1} (batch sizes {sizes[0]}..{sizes[-1]})")
            if torch.cuda.is_available():
                print(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
            print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
            self.profiler = None


def lower_bound(steps, hf, weight_bytes, dtype_bytes, bandwidth, flops_rate, tp_size=1, kv_dtype_bytes=None,
                num_params=None, expert_bytes=None):
    """Per rank (`weight_bytes`: rank 0's shard, as held: FP8 weights and their scales count their own
    bytes; `num_params`: its element count, default weight_bytes / dtype_bytes; `expert_bytes`: bytes
    of an MoE expert weight, 1 for FP8 experts, default dtype_bytes; KV heads, attention and the
    vocabulary split tp_size ways). MoE models: a step reads the non-expert weights and the experts
    its tokens route to (expected under uniform routing); a token's matmul FLOPs count its top-k
    experts only. Prefill FLOPs count at the bf16 matmul rate, FP8 or not."""
    from nanoinfer.bench.moe import moe_step_costs
    kv_heads = max(hf.num_key_value_heads // tp_size, 1)  # (replicated when fewer than ranks)
    from nanoinfer.models.config_limits import head_dim
    dim = head_dim(hf)
    kv_per_token = hf.num_hidden_layers * kv_heads * dim * 2 * (kv_dtype_bytes or dtype_bytes)
    expert_bytes = expert_bytes or dtype_bytes
    all_experts, expert_flops = moe_step_costs(hf, expert_bytes, float("inf"), tp_size)
    params = (weight_bytes / dtype_bytes if num_params is None else num_params) - all_experts / expert_bytes
    weight_bytes -= all_experts  # what every step reads
    embed = hf.vocab_size * hf.hidden_size / tp_size
    matmul_params = params - embed * (1 if hf.tie_word_embeddings else 2)  # per token, excluding vocab
    byte_time = flop_time = 0.0
    for step in steps:
        shape = step.rows
        kv_read = sum(ctx - q for q, ctx in shape) * kv_per_token  # cached context each step reads
        step_tokens = sum(q for q, _ in shape)
        experts_read = moe_step_costs(hf, expert_bytes, step_tokens, tp_size)[0]
        byte_time += (weight_bytes + experts_read + kv_read + step_tokens * kv_per_token) / bandwidth
        prefill = shape[step.num_decode:]  # (decode rows are counted by the bytes they read)
        if prefill:
            tokens = sum(q for q, _ in prefill)
            attn = sum(q * (ctx - q) + q * (q + 1) / 2 for q, ctx in prefill)  # causal query-key pairs
            flops = 2 * matmul_params * tokens + expert_flops * tokens + 2 * embed * len(prefill) \
                + 4 * hf.num_hidden_layers * hf.num_attention_heads // tp_size * dim * attn
            flop_time += flops / flops_rate
    return byte_time + flop_time


def run(llm: LLM, prompts, params, before_step=None) -> tuple[list, float]:
    """Run the requests to completion through the engine's public loop, as generate() does; returns
    its step log and the elapsed time."""
    if llm.config.device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    rids = llm.add_requests(prompts, params, keep_output=True)
    llm.step_log = []
    while not llm.is_finished():
        if before_step is not None:
            before_step()
        llm.advance()
    if llm.config.device == "cuda":
        torch.cuda.synchronize()
    for rid in rids:
        llm.pop_output(rid)
    t = time.perf_counter() - t
    steps, llm.step_log = llm.step_log, None
    return steps, t


def random_tokens(llm: LLM, length: int, rng=random) -> list[int]:
    """A prompt of `length` random token ids below 10,000 (and the vocabulary), drawn from rng."""
    return [rng.randint(0, min(10000, llm.vocab_size - 1)) for _ in range(length)]


def long_prompt_arrivals(llm: LLM, args):
    """Decode speed of running sequences while long prompts arrive (an online server's life): 64
    sequences (128-token prompts, 512 output tokens) stream; after 20 steps, then every 40, a
    long prompt arrives, 4 in all. Prints the running sequences' inter-token latency and tokens/s,
    alone and with the arrivals. Uses only the public API (stream, add_request), so it also runs
    against older engines."""
    def once(with_long: bool):
        short = [random_tokens(llm, 128) for _ in range(64)]
        sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512)
        long_sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
        gaps, last, count, arrivals = [], {}, 0, [20, 60, 100, 140] if with_long else []
        log = hasattr(llm, "step_log")  # (older engines have no step log)
        if log:
            llm.step_log = []
        t0 = time.perf_counter()
        for step, delta in enumerate(llm.stream(short, sp)):
            now = time.perf_counter()
            if delta.token_ids:
                if delta.index in last:
                    gaps.append(now - last[delta.index])
                last[delta.index] = now
                count += len(delta.token_ids)
            if arrivals and step // 64 >= arrivals[0]:  # about one delta per sequence per step
                arrivals.pop(0)
                llm.add_request(random_tokens(llm, args.long_prompt_len), long_sp)
        elapsed = time.perf_counter() - t0
        while not llm.is_finished():
            llm.step()
        gaps.sort()
        q = lambda f: gaps[min(int(f * len(gaps)), len(gaps) - 1)] * 1e3  # noqa: E731
        print(f"{'with 4 long prompts' if with_long else 'alone':>20}: running sequences {count / elapsed:8.0f} tok/s, "
              f"inter-token latency p50 {q(0.5):.2f} ms, p99 {q(0.99):.2f} ms, max {gaps[-1] * 1e3:.2f} ms")
        if log:
            steps, llm.step_log = llm.step_log, None
            walls = [b.start - a.start for a, b in zip(steps, steps[1:])]
            for name, keep in (("decode-only", lambda s: s.num_decode == len(s.rows)),
                               ("mixed", lambda s: 0 < s.num_decode < len(s.rows))):
                idx = [i for i, s in enumerate(steps[:-1]) if keep(s)]
                if idx:
                    print(f"{'':>22}{name} steps: {len(idx)}, wall {sum(walls[i] for i in idx) / len(idx) * 1e3:.2f} ms, "
                          f"launch {sum(steps[i].launched - steps[i].scheduled for i in idx) / len(idx) * 1e3:.2f} ms")

    print(f"long-prompt arrivals: 64 running sequences, 4 prompts of {args.long_prompt_len} tokens, "
          f"max_num_batched_tokens={llm.config.max_num_batched_tokens}")
    once(False)
    once(True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="a real checkpoint (directory or repo id) instead of random weights")
    p.add_argument("--config", choices=[*sorted(SHAPES), BUILTIN_TINY, BUILTIN_TINY_MOE], default="0.6b",
                   help=f"shape of the random model; {BUILTIN_TINY}: the built-in tiny checkpoint (CPU-sized: "
                        "tiny shapes and a 384-token vocabulary; 'tiny' has Qwen3's full vocabulary)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE shapes: each rank holds whole experts; prints the load per rank and the "
                        "dispatch/combine share of a step (the default workload)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="FP8 weights: random FP8 weights and scales, or a real checkpoint quantized at load")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="KV cache dtype (vLLM's kv_cache_dtype): fp8 stores K/V as e4m3, one byte each")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant mode (LLM(batch_invariant=True), docs/batch-invariant.md): compare a run "
                        "without it for its cost")
    p.add_argument("--long-prompts", action="store_true",
                   help="measure running sequences' decode while long prompts arrive (try --max-num-batched-tokens 2048)")
    p.add_argument("--long-prompt-len", type=int, default=8000)
    p.add_argument("--sweep", action="store_true", help="one table: batch 1, 8, 64, 256 and the nano-vllm workload")
    p.add_argument("--sweep-output-len", type=int, default=512)
    p.add_argument("--plot", metavar="FILE.png", help="draw tok/s and batch size over the run (needs matplotlib)")
    p.add_argument("--images", type=int, metavar="N",
                   help="the image workload instead: N requests, each one image and --image-input-len text tokens, "
                        "--image-output-len output tokens, on a random Qwen2.5-VL (--vl-config) or --model")
    p.add_argument("--vl-config", choices=["7b", "tiny"], default="7b", help="shape of the random Qwen2.5-VL")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--image-input-len", type=int, default=128)
    p.add_argument("--image-output-len", type=int, default=256)
    p.add_argument("--log-compiles", action="store_true",
                   help="list the Triton compiles and new allocator segments inside each timed workload run")
    p.add_argument("--profile", type=int, nargs=2, metavar=("FIRST", "LAST"), action="append", default=[],
                   help="profile steps FIRST..LAST with torch.profiler (perturbs the timing); repeatable")
    p.add_argument("--lora", type=int, metavar="N", default=0,
                   help="instead: N random LoRA adapters on all seven projections, rows using them in turn, "
                        "decode at batch 1 and 64 (128-token prompts, --sweep-output-len tokens) against the "
                        "base model (nanoinfer/bench/lora.py)")
    p.add_argument("--lora-rank", type=int, default=16, help="the --lora adapters' rank")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding's table (nanoinfer/bench/speculative.py): --config target (8b by "
                        "default here) with a --draft-config draft, plain / draft = target / disagreeing draft / "
                        "n-gram at --speculative-batches")
    p.add_argument("--draft-config", choices=sorted(SHAPES), default="0.6b", help="--speculative: the draft's shape")
    p.add_argument("--draft-model", help="--speculative: a real draft checkpoint (with --model)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--speculative-batches", default="1,8,64")
    p.add_argument("--speculative-prompt-len", type=int, default=128)
    p.add_argument("--speculative-runs", default="plain,same,same-sync,other,other-sync,policy,ngram",
                   help="--speculative: which runs (each its own engine); the computed table needs plain "
                        "and other-sync")
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # (the description's example command)
    args = p.parse_args()
    if args.config in (BUILTIN_TINY, BUILTIN_TINY_MOE) and not args.model:
        args.model = default_tiny_model_dir() if args.config == BUILTIN_TINY else default_tiny_moe_dir()
    if args.speculative:
        from nanoinfer.bench.speculative import main_args
        if "--config" not in " ".join(__import__("sys").argv):
            args.config = "8b"
        return main_args(args)
    if args.lora:
        from nanoinfer.bench.lora import compare
        model = args.model or make_random_model_dir(args.config)
        compare(model, args.lora, args.lora_rank, [1, 64], 128, args.sweep_output_len, dummy=args.model is None,
                enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size)
        return

    seed(args.seed)
    if args.images:
        from nanoinfer.bench.images import make_random_vl_model_dir
        model = args.model or make_random_vl_model_dir(args.vl_config)
    else:
        model = args.model or make_random_model_dir(args.config)
    max_model_len = max(args.max_model_len, args.long_prompt_len + 1) if args.long_prompts else args.max_model_len
    started = time.perf_counter()
    llm = LLM(model, enforce_eager=args.enforce_eager, max_model_len=max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, load_format="auto" if args.model else "dummy",
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              enable_expert_parallel=args.enable_expert_parallel, batch_invariant=args.batch_invariant)
    print(f"start-up (LLM(...), random weights included): {time.perf_counter() - started:.1f} s")
    if not args.images and (args.sweep or args.long_prompts):  # (the plain workload's first run is timed as the engine starts)
        warm_up(llm, args)
    if args.long_prompts:
        long_prompt_arrivals(llm, args)
        return llm.exit()
    bound_of = flops_rate = None
    info = llm.model_runner.info()
    if llm.config.device == "cuda":
        hf = llm.config.hf_config
        dtype_bytes = torch.tensor([], dtype=llm.config.torch_dtype).element_size()
        # (rank 0's shard; FP8 weights count 1 byte; a vision tower's weights are not read by every step)
        params = [p for n, p in llm.model_runner.model.named_parameters() if not n.startswith("visual.")]
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        num_params = sum(p.numel() for p in params)
        from nanoinfer.layers.fused_moe import ExpertsGateUp
        fp8_experts = any(isinstance(m, ExpertsGateUp) and m.scale is not None
                          for m in llm.model_runner.model.modules())
        bandwidth, flops_rate = measure_ceilings(torch.device("cuda"))
        print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")
        bound_of = lambda group: lower_bound(group, hf, weight_bytes, dtype_bytes, bandwidth, flops_rate,  # noqa: E731
                                             args.tensor_parallel_size, 1 if args.kv_cache_dtype != "auto" else None,
                                             num_params=num_params, expert_bytes=1 if fp8_experts else None)
    name = f"random Qwen2.5-VL-{args.vl_config}" if args.images else f"random Qwen3-{args.config}"
    print(f"model: {args.model or name}, device: {llm.config.device}, "
          f"weights: {args.quantization or 'model dtype'}, "
          f"tp={args.tensor_parallel_size}{' (expert parallel)' if args.enable_expert_parallel else ''}, "
          f"backend: {info['backend']}, "
          f"cuda graphs: {info['cuda_graphs']}, one-shot all-reduce: {info['one_shot_all_reduce']}, kv blocks: {llm.scheduler.block_manager.num_blocks} ({args.kv_cache_dtype})")
    if args.images:
        from nanoinfer.bench.images import image_workload
        image_workload(llm, args, bound_of, flops_rate, run)
    elif args.sweep:
        sweep(llm, args, bound_of)
    else:
        steps = first_and_second_run(llm, args, bound_of)
        if args.plot:
            plot(steps, args.plot)
        if llm.config.expert_parallel_size > 1:
            from nanoinfer.bench import expert_parallel
            loads, config = expert_parallel.rank_loads(llm), llm.config
            llm.exit()  # (the timing ranks take the devices)
            expert_parallel.report(config.hf_config, config.expert_parallel_size, loads, steps, step_walls(steps),
                                   config.torch_dtype, config.device == "cuda")
    llm.exit()


def first_and_second_run(llm: LLM, args, bound_of):
    """The workload right after LLM(...) (no warm-up: what the engine did not compile or tune at
    start-up is paid here), then again with fresh prompts of the same lengths; prints the first
    run's speed over the second's. Returns the second run's steps."""
    shape = [(randint(args.min_input_len, args.max_input_len), randint(args.min_output_len, args.max_output_len))
             for _ in range(args.num_seqs)]
    speeds = []
    for name in ("first run", "second run"):
        print(f"--- {name} (fresh prompts, same lengths)")
        log = None
        if args.log_compiles:
            from nanoinfer.bench.compile_log import CompileLog
            log = CompileLog()
        with log if log is not None else _null():
            steps, t, out_tokens = nano_vllm_workload(llm, args, bound_of, shape=shape, profile=name == "second run")
        speeds.append(out_tokens / t)
        if log is not None:
            print(log.report(name))
    print(f"first run / second run: {speeds[0]:.0f} / {speeds[1]:.0f} tok/s = {speeds[0] / speeds[1]:.3f}")
    return steps


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def warm_up(llm: LLM, args):
    """Compile before timing. After a one-prompt warm-up the first full prefill steps still compiled
    kernels inside the timed run (Triton specializes on integer arguments, such as a multiple of 16
    or not), which made the first timed run of a fresh process slower than the next. 64 prompts of the
    workload's lengths (from their own generator: the workload's prompts stay the same) fill whole
    token-budget chunks and a partial one, then decode a few steps; one short prompt covers batch 1."""
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    rng = Random(1)
    hi = max(1, min(args.max_input_len, args.max_model_len - 8))
    prompts = [random_tokens(llm, rng.randint(min(args.min_input_len, hi), hi), rng) for _ in range(64)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def nano_vllm_workload(llm: LLM, args, bound_of, verbose: bool = True, shape=None, profile: bool = True):
    """shape: (prompt length, output tokens) per request (None: drawn here); returns (steps, time,
    output tokens), after printing the run's figures when verbose."""
    if shape is None:
        shape = [(randint(args.min_input_len, args.max_input_len), randint(args.min_output_len, args.max_output_len))
                 for _ in range(args.num_seqs)]
    prompts = [random_tokens(llm, n) for n, _ in shape]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for _, m in shape]
    windows = [range(first, last + 1) for first, last in args.profile] if profile else []
    steps, t = run(llm, prompts, params, Profiler(llm, windows))
    out_tokens = sum(sp.max_tokens for sp in params)
    if not verbose:
        return steps, t, out_tokens
    decode = [s for s in steps if s.num_decode == len(s.rows)]
    print(f"Requests: {len(prompts)}, prompt tokens: {sum(len(p) for p in prompts)}, output tokens: {out_tokens}, "
          f"steps: {len(steps)} ({len(steps) - len(decode)} with prefill, {len(decode)} decode only), "
          f"preemptions: {llm.scheduler.num_preemptions}")
    print(f"Total: {out_tokens}tok, Time: {t:.2f}s, Throughput: {out_tokens / t:.2f}tok/s")
    # a step's wall time: from its start to the next step's start (the device work it launched
    # overlaps the next call's host work)
    walls = step_walls(steps)
    groups = [("steps with prefill", [i for i, s in enumerate(steps) if s.num_decode < len(s.rows)])]
    for lo, hi in ((200, 10**9), (64, 200), (1, 64)):
        groups.append((f"decode steps with {lo}..{min(hi, args.num_seqs + 1) - 1} seqs",
                       [i for i, s in enumerate(steps) if s.num_decode == len(s.rows) and lo <= len(s.rows) < hi]))
    for name, idx in groups:
        if idx:
            group = [steps[i] for i in idx]
            mean = lambda f: sum(map(f, group)) / len(group) * 1e3  # noqa: E731
            bound = f", bound {bound_of(group) / len(group) * 1e3:.2f} ms" if bound_of else ""
            print(f"{name}: {len(group):4d} steps, per step: schedule {mean(lambda s: s.scheduled - s.start):.2f} ms, "
                  f"launch {mean(lambda s: s.launched - s.scheduled):.2f} ms, "
                  f"process {mean(lambda s: s.end - s.launched):.2f} ms (incl. waiting for the device), "
                  f"whole step {sum(walls[i] for i in idx) / len(idx) * 1e3:.2f} ms{bound}")
    print(f"mean step time over the whole run: {t / len(steps) * 1e3:.2f} ms")
    if bound_of:
        bound = bound_of(steps)
        print(f"lower bound for this run: {bound:.2f}s ({out_tokens / bound:.0f} tok/s); "
              f"measured time is {bound / t * 100:.1f}% of the bound's speed")
    return steps, t, out_tokens


def step_walls(steps) -> list[float]:
    return [b.start - a.start for a, b in zip(steps, steps[1:])] + [steps[-1].end - steps[-1].start]


def sweep(llm: LLM, args, bound_of):
    """One table: decode at batch 1, 8, 64 and 256 (128-token prompts, --sweep-output-len tokens
    each), and the nano-vllm workload."""
    rows = []
    for batch in (1, 8, 64, 256):
        prompts = [random_tokens(llm, 128) for _ in range(batch)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.sweep_output_len)] * batch
        steps, t = run(llm, prompts, params)
        rows.append((f"batch {batch} (128 in, {args.sweep_output_len} out)", steps, t, batch * args.sweep_output_len))
    steps, t, out_tokens = nano_vllm_workload(llm, args, bound_of, verbose=False)
    rows.append((f"nano-vllm workload ({args.num_seqs} seqs)", steps, t, out_tokens))
    print(f"{'workload':<34} {'tok/s':>9} {'ms a decode step':>17} {'host ms':>8} {'bound tok/s':>12} "
          f"{'% of bound':>11}")
    for name, steps, t, out_tokens in rows:
        walls = step_walls(steps)
        decode = [(s, w) for s, w in zip(steps, walls) if s.num_decode == len(s.rows)]
        n = max(len(decode), 1)
        bound = bound_of(steps) if bound_of else None
        print(f"{name:<34} {out_tokens / t:9.0f} {sum(w for _, w in decode) / n * 1e3:17.2f} "
              f"{sum(s.host_s for s, _ in decode) / n * 1e3:8.2f} "
              + (f"{out_tokens / bound:12.0f} {bound / t * 100:10.1f}%" if bound else f"{'-':>12} {'-':>11}"))
    print("host ms: the engine process's own work per decode step (schedule, encode and launch, process the "
          "previous step), less its blocking waits for the device's results")


def plot(steps, path: str):
    """Output tokens/s and running batch size against time, prefill-carrying steps marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); skipped")
        return
    t0 = steps[0].start
    x = [s.start - t0 for s in steps]
    walls = step_walls(steps)
    rate = [s.num_decode / w for s, w in zip(steps, walls)]  # (a prompt's first token is not counted)
    fig, ax = plt.subplots(figsize=(10, 4))
    (rate_line,) = ax.plot(x, rate, lw=0.8, label="decode tokens/s (per step)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    (size_line,) = ax2.plot(x, [len(s.rows) for s in steps], color="tab:orange", lw=0.8, label="sequences in the step")
    ax2.set_ylabel("sequences in the step")
    for xi, s in zip(x, steps):
        if s.num_decode < len(s.rows):
            ax.axvline(xi, color="tab:red", alpha=0.25, lw=0.8)
    ax.set_title("bench.py: throughput and batch size over the run (red: steps with prefill)")
    ax.legend(handles=[rate_line, size_line], loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
