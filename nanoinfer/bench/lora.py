"""Multi-LoRA throughput against the base model, in one sitting: N random adapters of rank R on all
seven projections of each decoder layer (written as PEFT directories for the model's shape), rows
using the adapters in turn, decode at each batch size (128-token prompts, 512 output tokens), then
the same workload on the base model alone. Prints tok/s of both, their ratio, and the adapters'
share of a decode step (every LoRA layer's product less its base product, replayed from CUDA
graphs on their own, over the measured decode step). NANOINFER_LORA_TRITON=0 runs the torch expand on
CUDA instead of the Triton kernel.

    python3 bench.py --lora 4 --lora-rank 16 --config 8b        (issue 30's run, on the H200)
    python3 -m nanoinfer.bench.lora --model TINY_CKPT --batches 2 --output-len 4    (a CPU check)
"""
import argparse
import json
import os
import random
import tempfile
import time

from safetensors.torch import save_file
import torch
from transformers import AutoConfig

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.bench.random_model import make_random_model_dir
from nanoinfer.lora.linear import LoRALinearMethod
from nanoinfer.lora.targets import TARGET_MODULES, target_shapes
from nanoinfer.utils.context import reset_context, set_context


def make_random_adapters(model: str, num: int, rank: int, seed: int = 0) -> list[str]:
    """`num` PEFT adapter directories for the model at `model` (its config.json), rank `rank`, every
    target module, random bf16 weights (small: the outputs stay finite)."""
    hf = AutoConfig.from_pretrained(model)
    shapes = target_shapes(hf)
    paths = []
    gen = torch.Generator().manual_seed(seed)
    for i in range(num):
        path = os.path.join(tempfile.gettempdir(), f"nanoinfer-bench-lora-{os.path.basename(model)}-r{rank}-{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(hf.num_hidden_layers):
            for module in TARGET_MODULES:
                out_features, in_features = shapes[module]
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen) * 0.01).bfloat16()
                tensors[f"{name}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.01).bfloat16()
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank,
                           target_modules=[m.split(".")[1] for m in TARGET_MODULES]), f)
        paths.append(path)
    return paths


def decode_run(llm: LLM, batch: int, input_len: int, output_len: int, loras) -> tuple[float, float]:
    """(output tok/s, mean wall time of a decode-only step) for `batch` sequences."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(min(10000, llm.vocab_size)) for _ in range(input_len)] for _ in range(batch)]
    sp = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)] * batch
    requests = None if loras is None else [loras[i % len(loras)] for i in range(batch)]
    if llm.config.device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    rids = llm.add_requests(prompts, sp, keep_output=True, lora_requests=requests)
    llm.step_log = []
    while not llm.is_finished():
        llm.advance()
    if llm.config.device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter() - t
    for rid in rids:
        llm.pop_output(rid)
    steps, llm.step_log = llm.step_log, None
    walls = [(b.start - a.start) for a, b in zip(steps, steps[1:]) if a.num_decode == len(a.rows)]
    return batch * output_len / t, sum(walls) / max(len(walls), 1)


@torch.inference_mode()
def adapter_time(llm: LLM, batch: int, num_adapters: int, reps: int = 20) -> float | None:
    """Seconds the adapters add to one decode step of `batch` rows (rows in the adapters' slots in
    turn): every LoRA layer's product less its base product alone (over a dense base the shrink is
    part of the layer's product: what is timed is the whole difference). On CUDA both run replayed
    from a CUDA graph, as in the engine (no launch cost in the figure). tp=1 only: the layers live in
    this process."""
    runner = llm.model_runner
    if not hasattr(runner, "model"):
        return None
    device, dtype = runner.device, llm.config.torch_dtype
    layers = [m for m in runner.model.modules() if isinstance(getattr(m, "method", None), LoRALinearMethod)]
    inputs = [(layer, torch.randn(batch, layer.in_features, device=device, dtype=dtype)) for layer in layers]

    def with_adapters():
        for layer, x in inputs:
            layer.method.apply(layer, x)

    def base_only():
        for layer, x in inputs:
            layer.method.base.apply(layer, x)

    set_context(lora_slots=torch.arange(batch, device=device) % num_adapters)
    try:
        return timed(with_adapters, device, reps) - timed(base_only, device, reps)
    finally:
        reset_context()


def timed(fn, device: torch.device, reps: int) -> float:
    """Seconds a call of fn takes: replayed from a CUDA graph on CUDA, else called."""
    fn()
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def compare(model: str, num_adapters: int, rank: int, batches: list[int], input_len: int, output_len: int,
            dummy: bool, **options):
    adapters = [LoRARequest(f"bench{i}", i + 1, path)
                for i, path in enumerate(make_random_adapters(model, num_adapters, rank))]
    common = dict(load_format="dummy" if dummy else "auto", max_model_len=max(1024, input_len + output_len + 16),
                  max_num_seqs=max(batches), **options)
    results = {}
    for mode in ("lora", "base"):
        lora = mode == "lora"
        llm = LLM(model, enable_lora=lora, max_loras=num_adapters, max_lora_rank=rank, **common) if lora \
            else LLM(model, **common)
        try:
            warm = None if not lora else adapters
            decode_run(llm, min(len(adapters), max(batches)), input_len, 4, warm)  # compile, load the adapters
            for batch in batches:
                tok_s, step = decode_run(llm, batch, input_len, output_len, adapters if lora else None)
                share = adapter_time(llm, batch, num_adapters) if lora else None
                results[(mode, batch)] = (tok_s, step, share)
        finally:
            llm.exit()
    print(f"LoRA: {num_adapters} adapters of rank {rank} on all seven projections, rows using them in turn; "
          f"{input_len}-token prompts, {output_len} output tokens")
    print(f"{'batch':>6} {'base tok/s':>11} {'LoRA tok/s':>11} {'LoRA/base':>10} {'decode step base':>17} "
          f"{'decode step LoRA':>17} {'adapters share':>20}")
    for batch in batches:
        base, lora = results[("base", batch)], results[("lora", batch)]
        share = f"{lora[2] / lora[1] * 100:19.1f}%" if lora[2] is not None and lora[1] else f"{'-':>20}"
        print(f"{batch:6d} {base[0]:11.0f} {lora[0]:11.0f} {lora[0] / base[0] * 100:9.1f}% "
              f"{base[1] * 1e3:14.2f} ms {lora[1] * 1e3:14.2f} ms {share}")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory (default: a random model of --config's shape)")
    p.add_argument("--config", default="8b", help="the random model's shape (nanoinfer/bench/random_model.py)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()
    run_from_args(args)


def run_from_args(args):
    model = args.model or make_random_model_dir(args.config)
    compare(model, args.adapters, args.rank, args.batches, args.input_len, args.output_len,
            dummy=args.model is None, enforce_eager=args.enforce_eager)


if __name__ == "__main__":
    main()
