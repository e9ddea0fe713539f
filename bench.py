"""Throughput benchmark, nano-vllm's workload by default: 256 sequences, prompts of U[100, 1024] random
token ids, outputs of U[100, 1024] tokens (ignore_eos), temperature 0.6, max_model_len 4096, seed 0.

Without --model the model is Qwen3-0.6B-shaped (or 8B with --config 8b) with random weights: throughput
does not depend on the weights, and nothing is downloaded. On CUDA it also prints the run's lower bound:
sum over steps of (weight bytes + KV bytes read) / copy bandwidth + prefill FLOPs / bf16 matmul rate,
both ceilings measured in this process, and the per-step CPU time against the step time."""
import argparse
import json
import os
import tempfile
import time
from random import randint, seed

import torch

from nanoinfer import LLM, SamplingParams

CONFIGS = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def make_random_model_dir(shape: str) -> str:
    """A checkpoint directory with the Qwen3 config and a small local tokenizer; weights come from
    load_format='dummy'."""
    from nanoinfer.utils.tiny_model import train_tokenizer
    path = os.path.join(tempfile.gettempdir(), f"nanoinfer-bench-qwen3-{shape}")
    os.makedirs(path, exist_ok=True)
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_act="silu",
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                  torch_dtype="bfloat16", eos_token_id=2, bos_token_id=None, **CONFIGS[shape])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    train_tokenizer().save_pretrained(path)
    return path


def measure_ceilings(device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    from triton.testing import do_bench
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    bandwidth = 2 * src.numel() * 2 / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = do_bench(lambda: a @ b, return_mode="median")
    return bandwidth, 2 * 8192 ** 3 / (ms * 1e-3)


class StepRecorder:
    """Wraps the engine's step, scheduler and runner to record each step's shape and where its wall
    time goes: schedule, input preparation, the runner call (launch + device + wait), and the rest
    (postprocess, outputs)."""

    def __init__(self, llm: LLM, profile_windows: list[range] = ()):
        self.steps = []  # [is_prefill, [(query_len, context_len)], schedule_s, prepare_s, run_s, step_s]
        self.profile_windows, self.profiler = list(profile_windows), None
        runner, scheduler = llm.model_runner, llm.scheduler
        schedule, run, step = scheduler.schedule, runner.run, llm.step
        schedule_ahead = scheduler.schedule_ahead
        prep_prefill, prep_decode = runner.prepare_prefill, runner.prepare_decode

        def timed_schedule():
            self._profile(len(self.steps))
            t = time.perf_counter()
            seqs, is_prefill = schedule()
            shape = [(s.num_scheduled_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in seqs]
            self.steps.append([is_prefill, shape, time.perf_counter() - t, 0.0, 0.0, 0.0])
            return seqs, is_prefill

        def timed_schedule_ahead(inflight):
            self._profile(len(self.steps))
            t = time.perf_counter()
            seqs = schedule_ahead(inflight)
            if seqs:  # overlapped decode: each computes its in-flight token's successor
                self.steps.append([False, [(1, len(s) + 1) for s in seqs], time.perf_counter() - t, 0.0, 0.0, 0.0])
            return seqs

        def timed(fn, field):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                self.steps[-1][field] += time.perf_counter() - t
                return out
            return wrapper

        def timed_step():
            t = time.perf_counter()
            out = step()
            if self.steps:
                self.steps[-1][5] = time.perf_counter() - t
            return out

        scheduler.schedule, scheduler.schedule_ahead = timed_schedule, timed_schedule_ahead
        runner.prepare_prefill, runner.prepare_decode = timed(prep_prefill, 3), timed(prep_decode, 3)
        runner.run = timed(run, 4)
        if hasattr(runner, "launch_decode"):
            runner.launch_decode, runner.collect = timed(runner.launch_decode, 4), timed(runner.collect, 4)
        llm.step = timed_step

    def _profile(self, step: int):
        """Profile the given windows of steps with torch.profiler; print where device and host time go."""
        window = next((w for w in self.profile_windows if step in (w.start, w.stop)), None)
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
            sizes = sorted({len(s[1]) for s in self.steps[window.start:window.stop]})
            print(f"--- profile of steps {window.start}..{window.stop - 1} (batch sizes {sizes[0]}..{sizes[-1]})")
            if torch.cuda.is_available():
                print(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
            print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
            self.profiler = None


def lower_bound(steps, hf, weight_bytes, dtype_bytes, bandwidth, flops_rate):
    kv_per_token = hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * 2 * dtype_bytes
    params = weight_bytes / dtype_bytes
    embed = hf.vocab_size * hf.hidden_size
    matmul_params = params - embed * (1 if hf.tie_word_embeddings else 2)  # per token, excluding vocab
    byte_time = flop_time = 0.0
    for is_prefill, shape, *_ in steps:
        kv_read = sum(ctx - q for q, ctx in shape) * kv_per_token  # cached context each step reads
        byte_time += (weight_bytes + kv_read + sum(q for q, _ in shape) * kv_per_token) / bandwidth
        if is_prefill:
            tokens = sum(q for q, _ in shape)
            attn = sum(q * (ctx - q) + q * (q + 1) / 2 for q, ctx in shape)  # causal query-key pairs
            flops = 2 * matmul_params * tokens + 2 * embed * len(shape) \
                + 4 * hf.num_hidden_layers * hf.num_attention_heads * hf.head_dim * attn
            flop_time += flops / flops_rate
    return byte_time + flop_time


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="a real checkpoint (directory or repo id) instead of random weights")
    p.add_argument("--config", choices=sorted(CONFIGS), default="0.6b", help="shape of the random model")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, nargs=2, metavar=("FIRST", "LAST"), action="append", default=[],
                   help="profile steps FIRST..LAST with torch.profiler (perturbs the timing); repeatable")
    args = p.parse_args()

    seed(args.seed)
    model = args.model or make_random_model_dir(args.config)
    llm = LLM(model, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, load_format="auto" if args.model else "dummy")
    prompts = [[randint(0, 10000) for _ in range(randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=randint(args.min_output_len, args.max_output_len)) for _ in prompts]
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
    recorder = StepRecorder(llm, [range(first, last + 1) for first, last in args.profile])
    cuda = llm.config.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter() - t
    out_tokens = sum(sp.max_tokens for sp in params)
    in_tokens = sum(len(p) for p in prompts)
    steps = recorder.steps
    decode = [s for s in steps if not s[0]]
    print(f"model: {args.model or 'random Qwen3-' + args.config}, device: {llm.config.device}, "
          f"tp={args.tensor_parallel_size}, backend: {llm.model_runner.backend}, "
          f"cuda graphs: {bool(llm.model_runner.graphs)}, kv blocks: {llm.scheduler.block_manager.num_blocks}")
    print(f"Requests: {len(prompts)}, prompt tokens: {in_tokens}, output tokens: {out_tokens}, "
          f"steps: {len(steps)} ({len(steps) - len(decode)} prefill, {len(decode)} decode), "
          f"preemptions: {llm.scheduler.num_preemptions}")
    print(f"Total: {out_tokens}tok, Time: {t:.2f}s, Throughput: {out_tokens / t:.2f}tok/s")
    bound_of = None
    if cuda:
        hf = llm.config.hf_config
        dtype_bytes = torch.tensor([], dtype=llm.config.torch_dtype).element_size()
        weight_bytes = sum(p.numel() for p in llm.model_runner.model.parameters()) * dtype_bytes
        bandwidth, flops_rate = measure_ceilings(llm.model_runner.device)
        bound_of = lambda group: lower_bound(group, hf, weight_bytes, dtype_bytes, bandwidth, flops_rate)  # noqa: E731
    groups = [("prefill steps", [s for s in steps if s[0]])]
    for lo, hi in ((200, 10**9), (64, 200), (1, 64)):
        groups.append((f"decode steps with {lo}..{min(hi, args.num_seqs + 1) - 1} seqs",
                       [s for s in decode if lo <= len(s[1]) < hi]))
    for name, group in groups:
        if group:
            mean = [sum(s[i] for s in group) / len(group) * 1e3 for i in (2, 3, 4, 5)]
            bound = f", bound {bound_of(group) / len(group) * 1e3:.2f} ms" if bound_of else ""
            print(f"{name}: {len(group):4d} steps, per step: schedule {mean[0]:.2f} ms, input prep {mean[1]:.2f} ms, "
                  f"runner call {mean[2]:.2f} ms (incl. prep, launch, device, wait), whole step {mean[3]:.2f} ms{bound}")
    print(f"mean step time over the whole run: {t / len(steps) * 1e3:.2f} ms")
    if cuda:
        bound = bound_of(steps)
        print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")
        print(f"lower bound for this run: {bound:.2f}s ({out_tokens / bound:.0f} tok/s); "
              f"measured time is {bound / t * 100:.1f}% of the bound's speed")
    llm.exit()


if __name__ == "__main__":
    main()
