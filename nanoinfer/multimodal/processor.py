"""Intake of a request's images: the checkpoint's Hugging Face image processor
(preprocessor_config.json) makes each image's patches and grid; each image placeholder token of the
prompt (`<|image_pad|>`, written once per image inside `<|vision_start|>...<|vision_end|>`) is
expanded to the image's token count; the prompt's M-RoPE positions are computed.

Every problem is a ValueError / TypeError naming it: not an image, an empty image, a placeholder
count that differs from the image count, images for a text-only model, unknown processor options."""
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import xxhash

from nanoinfer.multimodal.inputs import ImageItem, MultiModalInputs
from nanoinfer.multimodal.limits import check_item_count
from nanoinfer.multimodal.mrope import mrope_positions

# mm_processor_kwargs the processor takes (vLLM's names for Qwen2-VL's pixel bounds)
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


def check_images(images) -> list:
    """multi_modal_data["image"]: one PIL image or a non-empty list of them, each of positive size."""
    from PIL import Image
    items = images if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ValueError("multi_modal_data['image'] is an empty list")
    for i, image in enumerate(items):
        if not isinstance(image, Image.Image):
            raise TypeError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got {type(image).__name__}")
        if image.width < 1 or image.height < 1:
            raise ValueError(f"multi_modal_data['image'][{i}] is empty ({image.width}x{image.height} pixels)")
    return list(items)


class MultiModalProcessor:
    def __init__(self, model_path: str, hf_config, vocab_size: int, limits: dict[str, int] | None = None):
        self.model_path, self.limits = model_path, limits
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.merge = hf_config.vision_config.spatial_merge_size
        self.vocab_size = vocab_size
        self._image_processor = None
        self._ahead: dict[int, Future] = {}  # id(multi_modal_data) -> its images' preprocessing, started by `batch`

    @property
    def image_processor(self):
        if self._image_processor is None:
            self._image_processor = load_image_processor(self.model_path)
        return self._image_processor

    @contextmanager
    def batch(self, prompts: list):
        """While inside, the images of these prompts are preprocessed in threads, all at once, ahead
        of each prompt's `process`; what is left is dropped. Only for a PIL processor: PIL and numpy
        release the GIL, while the torchvision one is mostly Python and runs slower in threads."""
        work = [p["multi_modal_data"] for p in prompts
                if isinstance(p, dict) and isinstance(p.get("multi_modal_data"), dict)
                and p["multi_modal_data"].get("image") is not None and not p.get("mm_processor_kwargs")]
        if len(work) < 2 or not runs_on_pil(self.image_processor):
            yield
            return
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="nanoinfer-images") as pool:
            images = [data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]] for data in work]
            self._ahead = {id(data): pool.submit(self._preprocess, list(ims), {}) for data, ims in zip(work, images)}
            try:
                yield
            finally:
                for future in self._ahead.values():
                    future.cancel()
                self._ahead = {}

    def process(self, token_ids: list[int], data: dict | None,
                kwargs: dict | None) -> tuple[list[int], MultiModalInputs | None]:
        """The prompt's token ids with each image placeholder expanded, and its MultiModalInputs (None
        for a prompt without images)."""
        unknown = sorted(set(data or {}) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data takes 'image' (a PIL image or a list of them); "
                             f"{unknown} are not supported")
        images = check_images(data["image"]) if data and data.get("image") is not None else []
        check_item_count(self.limits, "image", len(images))
        placeholders = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise ValueError("the prompt holds a video placeholder (<|video_pad|>); videos are not supported")
        if len(placeholders) != len(images):
            raise ValueError(f"the prompt holds {len(placeholders)} image placeholder(s) (<|image_pad|>, one per image "
                             f"inside <|vision_start|>...<|vision_end|>) but multi_modal_data has {len(images)} "
                             "image(s)")
        if kwargs and not images:
            raise ValueError("mm_processor_kwargs given without images")
        if not images:
            return token_ids, None
        ahead = self._ahead.pop(id(data), None)
        pixel_values, grids, keys = ahead.result() if ahead is not None and not kwargs else \
            self._preprocess(images, kwargs or {})
        expanded, items = [], []
        done = 0
        for placeholder, pixels, grid, key in zip(placeholders, pixel_values, grids, keys):
            expanded += token_ids[done:placeholder]
            count = grid[0] * grid[1] * grid[2] // self.merge ** 2
            items.append(ImageItem(len(expanded), count, key, pixels, grid))
            expanded += [self.image_token_id] * count
            done = placeholder + 1
        expanded += token_ids[done:]
        positions, delta = mrope_positions(len(expanded), [(im.offset, *im.grid_thw) for im in items], self.merge)
        return expanded, MultiModalInputs(tuple(items), positions, delta)

    def _preprocess(self, images: list, kwargs: dict) -> tuple[list[np.ndarray], list[tuple[int, int, int]], list[int]]:
        """Each image's patches, (t, h, w) grid and content key, through the checkpoint's image
        processor."""
        size = processor_size(self.image_processor, kwargs)
        try:
            out = self.image_processor(images=images, return_tensors="np", size=size)
        except Exception as e:  # a corrupt or unusable image: the request's fault
            raise ValueError(f"the image processor failed on multi_modal_data['image']: {type(e).__name__}: "
                             f"{str(e)[:300]}") from e
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        sizes = [t * h * w for t, h, w in grids]
        pixels = list(np.split(np.asarray(out["pixel_values"], dtype=np.float32), np.cumsum(sizes)[:-1]))
        return pixels, grids, [image_key(image, size) for image in images]


def image_key(image, size: dict) -> int:
    """An image's content key: its mode, size, palette and pixels, and the pixel bounds it is resized
    under. The processor is deterministic, so equal keys mean equal patches; the source image is
    several times fewer bytes to hash than its float32 patches."""
    h = xxhash.xxh3_64()
    h.update(repr((image.mode, image.size, sorted(size.items()), image.info.get("transparency"))).encode())
    palette = image.getpalette()  # (a "P" image's pixels index into it)
    if palette:
        h.update(bytes(palette))
    h.update(image.tobytes())
    return h.intdigest()


def runs_on_pil(image_processor) -> bool:
    """Whether transformers' image processor works on PIL images (its PIL backend, or a transformers
    4 "slow" processor) rather than torch tensors (the torchvision backend, or a 4.x "Fast" one)."""
    names = [cls.__name__ for cls in type(image_processor).__mro__]
    return not any("Torchvision" in name or name.endswith("Fast") for name in names)


def processor_size(image_processor, kwargs: dict) -> dict:
    """The processor's pixel bounds ({"shortest_edge": min pixels, "longest_edge": max pixels}), with
    mm_processor_kwargs' min_pixels / max_pixels applied."""
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(f"mm_processor_kwargs takes {list(PROCESSOR_KWARGS)}; {unknown} are not supported")
    size = dict(getattr(image_processor, "size", None) or {})
    lo = size.get("shortest_edge", getattr(image_processor, "min_pixels", None))
    hi = size.get("longest_edge", getattr(image_processor, "max_pixels", None))
    for name in PROCESSOR_KWARGS:
        value = kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mm_processor_kwargs['{name}'] must be a positive int, got {value!r}")
    lo, hi = kwargs.get("min_pixels", lo), kwargs.get("max_pixels", hi)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"mm_processor_kwargs: min_pixels={lo} exceeds max_pixels={hi}")
    return {"shortest_edge": lo, "longest_edge": hi}


def load_image_processor(model_path: str):
    """The checkpoint's image processor (transformers' class named by preprocessor_config.json; the
    PIL one when torchvision is absent). Needs Pillow: `pip install nanoinfer[vision]`."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ValueError("images need Pillow: pip install 'nanoinfer[vision]'") from None
    if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        raise ValueError(f"the checkpoint {model_path!r} has no preprocessor_config.json (its image processor)")
    from transformers import AutoImageProcessor
    try:
        return AutoImageProcessor.from_pretrained(model_path, trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"could not load the image processor of {model_path!r}: {e}") from e
