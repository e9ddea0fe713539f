"""The image workload of bench.py (`--images N`): N requests, each one image (448x448 by default) and
128 random text tokens, 256 output tokens, on a Qwen2.5-VL-shaped model with random weights (or a
real checkpoint). Reports tokens/s, the vision encoder's time per image (measured in the run: CUDA
events around each encoder call, no added sync), and the run's lower bound: the language model's
(bench.py's bound over the run's steps, image tokens counted as prompt tokens) plus the vision
tower's FLOPs at the matmul rate."""
import json
import os
import tempfile
import time
from random import Random

import numpy as np
import torch

from nanoinfer import SamplingParams
from nanoinfer.models.qwen2_5_vision import window_order
from nanoinfer.multimodal.feature import ImageFeature
from nanoinfer.multimodal.tiny_model import save_image_processor, vl_config, vl_tokenizer

VL_SHAPES = {
    "7b": dict(text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, mrope_section=[16, 24, 24]),
               vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           fullatt_block_indexes=[7, 15, 23, 31], window_size=112)),
    "tiny": dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=None, mrope_section=[2, 3, 3]),
                 vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                             fullatt_block_indexes=[1], window_size=112)),
}


def make_random_vl_model_dir(shape: str) -> str:
    """A Qwen2.5-VL directory of `shape` (VL_SHAPES) with no weights (load it with load_format='dummy'):
    config.json, the PIL image processor with Qwen2.5-VL's pixel bounds, a small local tokenizer."""
    path = os.path.join(tempfile.gettempdir(), f"nanoinfer-bench-qwen2_5_vl-{shape}")
    os.makedirs(path, exist_ok=True)
    tokenizer = vl_tokenizer()
    text, vision = dict(VL_SHAPES[shape]["text"]), VL_SHAPES[shape]["vision"]
    config = vl_config(tokenizer, hidden_size=text["hidden_size"], num_layers=text["num_hidden_layers"],
                       num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
                       intermediate_size=text["intermediate_size"], vision_hidden=vision["hidden_size"],
                       vision_heads=vision["num_heads"], vision_depth=vision["depth"],
                       fullatt_block_indexes=vision["fullatt_block_indexes"], window_size=vision["window_size"],
                       mrope_section=text["mrope_section"], max_position_embeddings=32768,
                       vocab_size=text["vocab_size"])
    config.vision_config.intermediate_size = vision["intermediate_size"]
    config.vision_config.out_hidden_size = vision["out_hidden_size"]
    config.text_config.rope_parameters["rope_theta"] = 1000000.0
    config.dtype = "bfloat16"
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:  # (save_pretrained may leave no architectures)
        saved = json.load(f)
    saved["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)
    tokenizer.save_pretrained(path)
    save_image_processor(path, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    return path


def vision_flops(vision, grids: list[tuple[int, int, int]]) -> float:
    """Matmul and attention FLOPs of the vision tower over these images (patch embedding, every block's
    projections, MLP and window / full attention, the merger)."""
    d, inner, merge = vision.hidden_size, vision.intermediate_size, vision.spatial_merge_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    n = sum(t * h * w for t, h, w in grids)
    window = vision.window_size // merge // vision.patch_size
    windows = window_order(grids, merge, window)[1]
    frames = [h * w for t, h, w in grids for _ in range(t)]
    per_block = 2 * n * d * (3 * d + d + 3 * inner)
    flops = 2 * n * patch * d
    for i in range(vision.depth):
        segments = frames if i in set(vision.fullatt_block_indexes) else windows
        flops += per_block + 4 * d * sum(s * s for s in segments)
    merged = n // merge ** 2
    wide = d * merge ** 2
    return flops + 2 * merged * wide * (wide + vision.out_hidden_size)


class EncoderTimer:
    """Wraps the model's encode_images: the time of every call (CUDA events, read after the run)."""

    def __init__(self, model, cuda: bool):
        self.model, self.cuda, self.calls = model, cuda, []
        self.real = model.encode_images
        model.encode_images = self

    def __call__(self, pixels, grids):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.real(pixels, grids)
            end.record()
            self.calls.append((start, end, len(grids)))
        else:
            t = time.perf_counter()
            out = self.real(pixels, grids)
            self.calls.append((t, time.perf_counter(), len(grids)))
        return out

    def seconds(self) -> tuple[float, int]:
        """Total encoder time and images encoded."""
        total = sum(a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b, _ in self.calls)
        return total, sum(n for _, _, n in self.calls)

    def restore(self):
        self.model.encode_images = self.real


def image_requests(llm, num: int, size: int, text_len: int, seed: int = 0) -> list[dict]:
    """Token-id prompts: the image placeholder, then text_len random text tokens; one random image each."""
    from PIL import Image  # optional dependency (nanoinfer[vision])
    rng = np.random.RandomState(seed)
    hf = llm.config.hf_config
    words = Random(seed)
    top = min(llm.tokenizer.vocab_size, hf.vision_start_token_id) - 1  # ordinary tokens, none of the vision ones
    out = []
    for _ in range(num):
        image = Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8"))
        ids = [hf.vision_start_token_id, hf.image_token_id, hf.vision_end_token_id]
        ids += [words.randint(0, top) for _ in range(text_len)]
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": image}})
    return out


def image_workload(llm, args, bound_of, flops_rate: float | None, run) -> None:
    """bench.py --images N. bound_of(steps): the language model's bound (None off CUDA); run: bench.py's
    run(llm, prompts, params) -> (steps, seconds)."""
    cuda = llm.config.device == "cuda"
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.image_output_len)
    # warm-up, as bench.py's for text: as many requests of the same shapes, other images (kernels
    # compile for the step's sizes, the pinned staging of a step's pixels is allocated once)
    llm.generate(image_requests(llm, args.images, args.image_size, args.image_input_len, seed=1),
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    requests = image_requests(llm, args.images, args.image_size, args.image_input_len)
    timer = EncoderTimer(llm.model_runner.model, cuda) if args.tensor_parallel_size == 1 else None
    intake_processor = llm.input_processor
    process_all, intake = intake_processor.process_all, []

    def timed_intake(*a, **kw):  # request intake on the host (the image processor, tokens), in the timed run
        t0 = time.perf_counter()
        try:
            return process_all(*a, **kw)
        finally:
            intake.append(time.perf_counter() - t0)
    intake_processor.process_all = timed_intake
    try:
        steps, t = run(llm, requests, [sp] * len(requests))
    finally:
        del intake_processor.process_all
        if timer is not None:
            timer.restore()
    out_tokens = args.images * args.image_output_len
    prompt_tokens = sum(q for s in steps for q, _ in s.rows[s.num_decode:])
    print(f"images: {args.images} requests, one {args.image_size}x{args.image_size} image + {args.image_input_len} "
          f"text tokens each, {args.image_output_len} output tokens; prompt tokens computed {prompt_tokens}, "
          f"steps {len(steps)}, preemptions {llm.scheduler.num_preemptions}")
    print(f"Total: {out_tokens}tok, Time: {t:.2f}s, Throughput: {out_tokens / t:.2f}tok/s")
    if timer is not None:
        seconds, images = timer.seconds()
        print(f"vision encoder: {images} images in {len(timer.calls)} calls, {seconds / max(images, 1) * 1e3:.2f} ms "
              f"per image ({seconds / t * 100:.1f}% of the run)")
    print(f"request intake (image processor in threads, tokens): {sum(intake) * 1e3 / args.images:.2f} ms per "
          f"request ({sum(intake) / t * 100:.1f}% of the run)")
    grid = llm.feature(ImageFeature).processor._preprocess([requests[0]["multi_modal_data"]["image"]], {})[1][0]
    flops = vision_flops(llm.config.hf_config.vision_config, [grid] * args.images)
    print(f"vision tower: grid {grid}, {flops / args.images / 1e9:.1f} GFLOP per image")
    if bound_of is not None and flops_rate:
        language = bound_of(steps)
        bound = language + flops / flops_rate
        print(f"lower bound for this run: {bound:.2f}s (language model {language:.2f}s + vision tower "
              f"{flops / flops_rate:.2f}s; {out_tokens / bound:.0f} tok/s); measured time is "
              f"{bound / t * 100:.1f}% of the bound's speed")
    if cuda:
        torch.cuda.synchronize()
