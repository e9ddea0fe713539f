"""OpenAI chat content parts that carry images: `{"type": "image_url", "image_url": {"url": ...}}`
and `{"type": "image_pil", "image_pil": <PIL image>}` (vLLM's); their images join the request's
multi_modal_data. As vLLM, by what the chat template takes:
- a template that renders content parts itself (Qwen2-VL's and its successors' own templates) gets
  the message's parts in order, each image as {"type": "image"}, and writes the placeholders;
- any other template gets one string: the images' placeholders first, then the texts, joined with
  newlines."""
import hashlib
import threading
from collections.abc import Mapping

from nanoinfer.multimodal.media import MediaLoader

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PART_TYPES = ("image_url", "image_pil")


def image_of_part(part: Mapping, where: str, media: MediaLoader | None, max_pixels: int | None = None):
    """The PIL image of an image content part; a URL's image of at most `max_pixels` pixels."""
    kind = part["type"]
    if media is None:
        raise ValueError(f"{where} has type {kind!r}: image parts need a vision-language model")
    if kind == "image_pil":
        from PIL import Image  # optional dependency (nanoinfer[vision])
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise TypeError(f"{where}['image_pil'] must be a PIL.Image.Image, got {type(image).__name__}")
        return image
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str):
        raise TypeError(f"{where}['image_url'] must be {{'url': str}}, got {ref!r:.100}")
    try:
        return media.load_image(url, max_pixels)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def join_content(texts: list[str], num_images: int) -> str:
    return "\n".join([PLACEHOLDER] * num_images + texts)


_TAKES_PARTS: dict[tuple[int, bytes | None], bool] = {}
_TAKES_PARTS_LOCK = threading.Lock()
TAKES_PARTS_CACHE_SIZE = 64  # templates remembered (a server's request templates are many and large)


def template_takes_parts(tokenizer, chat_template: str | None) -> bool:
    """Whether the template renders a list of content parts, writing an image part as the image
    placeholder (a probe render, once per tokenizer and template while it is remembered)."""
    digest = None if chat_template is None else hashlib.sha256(chat_template.encode("utf-8", "replace")).digest()
    key = (id(tokenizer), digest)
    with _TAKES_PARTS_LOCK:
        if key in _TAKES_PARTS:
            return _TAKES_PARTS[key]
    probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "nanoinfer-probe"}]}]
    try:
        text = tokenizer.apply_chat_template(probe, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=False)
        takes = "<|image_pad|>" in text and "nanoinfer-probe" in text and "'type'" not in text
    except Exception:  # a template that cannot take parts
        takes = False
    with _TAKES_PARTS_LOCK:
        while len(_TAKES_PARTS) >= TAKES_PARTS_CACHE_SIZE:
            del _TAKES_PARTS[next(iter(_TAKES_PARTS))]  # the oldest
        _TAKES_PARTS[key] = takes
    return takes
