"""OpenAI chat content parts that carry images: `{"type": "image_url", "image_url": {"url": ...}}`
and `{"type": "image_pil", "image_pil": <PIL image>}` (vLLM's). A message's image parts become the
model's image placeholder in its text (before the text, joined with newlines, as vLLM does for
templates that take string content), and their images join the request's multi_modal_data."""
from collections.abc import Mapping

from nanoinfer.multimodal.media import MediaLoader

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PART_TYPES = ("image_url", "image_pil")


def image_of_part(part: Mapping, where: str, media: MediaLoader | None):
    """The PIL image of an image content part."""
    kind = part["type"]
    if media is None:
        raise ValueError(f"{where} has type {kind!r}: image parts need a vision-language model")
    if kind == "image_pil":
        from PIL import Image
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise TypeError(f"{where}['image_pil'] must be a PIL.Image.Image, got {type(image).__name__}")
        return image
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str):
        raise TypeError(f"{where}['image_url'] must be {{'url': str}}, got {ref!r:.100}")
    try:
        return media.load_image(url)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def join_content(texts: list[str], num_images: int) -> str:
    return "\n".join([PLACEHOLDER] * num_images + texts)
