"""Intake of a request's images: the checkpoint's Hugging Face image processor
(preprocessor_config.json) makes each image's patches and grid; each image placeholder token of the
prompt (`<|image_pad|>`, written once per image inside `<|vision_start|>...<|vision_end|>`) is
expanded to the image's token count; the prompt's M-RoPE positions are computed.

Two parts: what is cheap is decided at once (the checks, and each image's token count from its
size, as the processor's `get_number_of_image_patches` tells without its pixels), so the prompt's
length is known before queueing; the preprocessing itself (resizing, normalising, hashing the
pixels) is returned as work that the engine runs in an intake thread (feature.py, engine/input_processor.py).

Every problem is a ValueError / TypeError naming it: not an image, an empty image, an image over
max_image_pixels, a placeholder count that differs from the image count, images for a text-only
model, unknown processor options."""
import os
from collections.abc import Callable

import numpy as np
import xxhash

from nanoinfer.multimodal.inputs import ImageItem, MultiModalInputs
from nanoinfer.multimodal.limits import check_item_count
from nanoinfer.multimodal.media import MAX_IMAGE_PIXELS
from nanoinfer.multimodal.mrope import mrope_positions

# mm_processor_kwargs the processor takes (vLLM's names for Qwen2-VL's pixel bounds)
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


def check_images(images, max_pixels: int = MAX_IMAGE_PIXELS) -> list:
    """multi_modal_data["image"]: one PIL image or a non-empty list of them, each of positive size
    and at most `max_pixels` pixels."""
    from PIL import Image  # optional dependency (nanoinfer[vision])
    items = images if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ValueError("multi_modal_data['image'] is an empty list")
    for i, image in enumerate(items):
        if not isinstance(image, Image.Image):
            raise TypeError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got {type(image).__name__}")
        if image.width < 1 or image.height < 1:
            raise ValueError(f"multi_modal_data['image'][{i}] is empty ({image.width}x{image.height} pixels)")
        if image.width * image.height > max_pixels:
            raise ValueError(f"multi_modal_data['image'][{i}] is {image.width}x{image.height} pixels, more than "
                             f"max_image_pixels={max_pixels}")
    return list(items)


class MultiModalProcessor:
    def __init__(self, model_path: str, hf_config, vocab_size: int, limits: dict[str, int] | None = None,
                 max_image_pixels: int = MAX_IMAGE_PIXELS):
        self.model_path, self.limits = model_path, limits
        self.max_image_pixels = max_image_pixels
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.merge = hf_config.vision_config.spatial_merge_size
        self.vocab_size = vocab_size
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            self._image_processor = load_image_processor(self.model_path)
        return self._image_processor

    def process(self, token_ids: list[int], data: dict | None,
                kwargs: dict | None) -> tuple[list[int], Callable[[], MultiModalInputs] | None]:
        """The prompt's token ids with each image placeholder expanded, and the work that makes its
        MultiModalInputs (None for a prompt without images): cheap checks here, the preprocessing
        in the returned work (a ValueError there fails the request)."""
        unknown = sorted(set(data or {}) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data takes 'image' (a PIL image or a list of them); "
                             f"{unknown} are not supported")
        images = check_images(data["image"], self.max_image_pixels) if data and data.get("image") is not None else []
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
        kwargs = kwargs or {}
        counts = self._token_counts(images, kwargs)
        if counts is None:  # (a processor that cannot tell: preprocessed here)
            done = self._preprocess(images, kwargs)
            counts = [t * h * w // self.merge ** 2 for t, h, w in done[1]]
            prepared = lambda: done  # noqa: E731
        else:
            prepared = lambda: self._preprocess(images, kwargs)  # noqa: E731
        expanded, offsets, start = [], [], 0
        for placeholder, count in zip(placeholders, counts):
            expanded += token_ids[start:placeholder]
            offsets.append(len(expanded))
            expanded += [self.image_token_id] * count
            start = placeholder + 1
        expanded += token_ids[start:]
        return expanded, lambda: self._inputs(len(expanded), offsets, counts, *prepared())

    def _token_counts(self, images: list, kwargs: dict) -> list[int] | None:
        """Each image's language-model token count from its size alone, or None if the processor
        cannot tell (then the images are preprocessed at once)."""
        count_patches = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count_patches is None:
            return None
        size = processor_size(self.image_processor, kwargs)
        try:
            return [count_patches(image.height, image.width, {"size": size}) // self.merge ** 2 for image in images]
        except ValueError as e:  # e.g. an aspect ratio the processor refuses
            raise ValueError(f"multi_modal_data['image']: {e}") from None

    def _inputs(self, num_tokens: int, offsets: list[int], counts: list[int], pixel_values: list,
                grids: list, keys: list) -> MultiModalInputs:
        """The prompt's MultiModalInputs from its images' preprocessing (in an intake thread)."""
        items = []
        for offset, count, pixels, grid, key in zip(offsets, counts, pixel_values, grids, keys):
            if grid[0] * grid[1] * grid[2] // self.merge ** 2 != count:
                raise ValueError(f"the image processor made a {grid} grid, not the {count} tokens its size gave")
            items.append(ImageItem(offset, count, key, pixels, grid))
        positions, delta = mrope_positions(num_tokens, [(im.offset, *im.grid_thw) for im in items], self.merge)
        return MultiModalInputs(tuple(items), positions, delta)

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
        import PIL  # noqa: F401  (optional dependency: nanoinfer[vision])
    except ImportError:
        raise ValueError("images need Pillow: pip install 'nanoinfer[vision]'") from None
    if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        raise ValueError(f"the checkpoint {model_path!r} has no preprocessor_config.json (its image processor)")
    # (imported here, on the vision path only: transformers' image-processing modules are slow to
    # import, and every engine, server and worker start would pay for them)
    from transformers import AutoImageProcessor
    try:
        return AutoImageProcessor.from_pretrained(model_path, trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"could not load the image processor of {model_path!r}: {e}") from e
