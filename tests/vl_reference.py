"""Teacher-forced Qwen2.5-VL / Qwen3-VL reference: HF's model, fed HF's image processor's pixel_values and
image_grid_thw, and a prompt whose image placeholders are expanded here (independently of nanoinfer)."""
import numpy as np
import torch

_MODELS = {}


def random_image(width: int, height: int, seed: int = 0):
    from PIL import Image
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def hf_vl_model(path: str):
    if path not in _MODELS:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        _MODELS[path] = (model, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    return _MODELS[path]


def hf_inputs(path: str, prompt: str, images: list, processor_kwargs: dict | None = None):
    """(expanded prompt ids, pixel_values, image_grid_thw) as HF's processor pipeline makes them."""
    model, image_processor, tokenizer = hf_vl_model(path)
    ids = tokenizer.encode(prompt)
    pad = model.config.image_token_id
    if not images:
        return ids, None, None
    out = image_processor(images=images, return_tensors="pt", **(processor_kwargs or {}))
    counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
    expanded = []
    for t in ids:
        expanded += [pad] * next(counts) if t == pad else [t]
    return expanded, out["pixel_values"], out["image_grid_thw"]


def assert_vl_greedy_matches_hf(path: str, prompt: str, images: list, prompt_ids: list[int],
                                completion: list[int], processor_kwargs: dict | None = None, tol: float = 1e-4):
    """Our expanded prompt equals HF's, and every completion token is HF's argmax (or within `tol`
    of the max logit) given the prompt and our earlier tokens."""
    model, _, _ = hf_vl_model(path)
    expected_ids, pixels, grid = hf_inputs(path, prompt, images, processor_kwargs)
    assert prompt_ids == expected_ids
    ids = torch.tensor([prompt_ids + list(completion)])
    kwargs = {}
    if pixels is not None:
        kwargs = dict(pixel_values=pixels, image_grid_thw=grid,
                      mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0, len(prompt_ids) - 1:-1]
    ours = logits.gather(1, torch.tensor(completion)[:, None])[:, 0]
    gap = logits.max(-1).values - ours
    bad = (gap > tol).nonzero().flatten().tolist()
    assert not bad, f"tokens differ from HF argmax at completion positions {bad[:5]} (gaps {gap[bad[:5]].tolist()})"


def hf_prompt_logprobs(path: str, prompt: str, images: list, prompt_ids: list[int]) -> list[float]:
    """HF's log-probability of each prompt token after the first, given the tokens before it."""
    model, _, _ = hf_vl_model(path)
    expected_ids, pixels, grid = hf_inputs(path, prompt, images)
    assert prompt_ids == expected_ids
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=(ids == model.config.image_token_id).int()).logits[0, :-1]
    return logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0].tolist()
