"""Images named by URL in chat content parts, and the rules on what may be read (vLLM's):

- `data:image/...;base64,...` URLs always;
- `file://` URLs only for files under `allowed_local_media_path` (none by default);
- `http(s)://` URLs only for hosts in `allowed_media_domains` (none by default), fetched with
  httpx within MAX_IMAGE_BYTES and FETCH_TIMEOUT_S (the whole fetch), redirects not followed (they could leave the
  allowed hosts);
- anything else is a ValueError naming the rule. Nothing is read or fetched before its rule allows it.

A URL whose bytes are not an image is a ValueError too."""
import base64
import binascii
import io
import os
import time
from urllib.parse import unquote, urlparse

import httpx

MAX_IMAGE_BYTES = 20 << 20   # an encoded image, from any source
FETCH_TIMEOUT_S = 10.0
MAX_IMAGE_PIXELS = 1 << 26   # decoded size (8192 x 8192): a decompression bomb is refused before it is decoded
MAX_REQUEST_PIXELS = 1 << 26  # all of one conversation's images together (a small PNG decodes to 192 MB)


class MediaLoader:
    def __init__(self, allowed_local_media_path: str | None = None, allowed_media_domains=None,
                 max_image_pixels: int | None = None):
        self.max_image_pixels = max_image_pixels  # (--max-image-pixels; None: MAX_IMAGE_PIXELS)
        self.local_root = None
        if allowed_local_media_path:
            if not isinstance(allowed_local_media_path, (str, os.PathLike)):
                raise TypeError("allowed_local_media_path must be a directory path")
            root = os.path.realpath(os.path.expanduser(os.fspath(allowed_local_media_path)))
            if not os.path.isdir(root):
                raise ValueError(f"allowed_local_media_path {allowed_local_media_path!r} is not a directory")
            self.local_root = root
        if isinstance(allowed_media_domains, str):
            allowed_media_domains = [allowed_media_domains]
        if allowed_media_domains is not None and not all(isinstance(d, str) and d for d in allowed_media_domains):
            raise TypeError("allowed_media_domains must be a list of host names")
        self.domains = frozenset(d.lower() for d in allowed_media_domains or ())

    def load_image(self, url: str, max_pixels: int | None = None):
        """The PIL image a URL names, under the rules above, of at most `max_pixels` pixels (None:
        max_image_pixels)."""
        if not isinstance(url, str):
            raise TypeError(f"an image_url's url must be a str, got {type(url).__name__}")
        cap = MAX_IMAGE_PIXELS if self.max_image_pixels is None else self.max_image_pixels
        max_pixels = cap if max_pixels is None else min(max_pixels, cap)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_image(_data_url_bytes(url), max_pixels)
        if scheme == "file":
            return decode_image(self._read_file(url), max_pixels)
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url), max_pixels)
        raise ValueError(f"image URL scheme {scheme or url[:20]!r} is not allowed: use a data: URL, a file:// URL "
                         "under --allowed-local-media-path, or an http(s):// URL of --allowed-media-domains")

    def _read_file(self, url: str) -> bytes:
        if self.local_root is None:
            raise ValueError("file:// image URLs are refused: the server / LLM was started without "
                             "allowed_local_media_path (--allowed-local-media-path)")
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// image URL with host {parsed.netloc!r} is not allowed")
        path = os.path.realpath(unquote(parsed.path))
        if os.path.commonpath([path, self.local_root]) != self.local_root:
            raise ValueError(f"file:// image URL {url[:200]!r} is outside allowed_local_media_path")
        if not os.path.isfile(path):
            raise ValueError(f"file:// image URL {url[:200]!r} names no file")
        if os.path.getsize(path) > MAX_IMAGE_BYTES:
            raise ValueError(f"image file {url[:200]!r} is larger than {MAX_IMAGE_BYTES} bytes")
        with open(path, "rb") as f:
            return f.read()

    def _fetch(self, url: str) -> bytes:
        host = (urlparse(url).hostname or "").lower()
        if host not in self.domains:
            raise ValueError(f"image URL host {host!r} is not in allowed_media_domains (--allowed-media-domains); "
                             "http(s) images are fetched only from the hosts listed there")
        data = bytearray()
        deadline = time.monotonic() + FETCH_TIMEOUT_S  # the whole fetch (httpx's timeout is per read)
        try:
            with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as reply:
                if reply.status_code != 200:
                    raise ValueError(f"fetching image URL {url[:200]!r} answered HTTP {reply.status_code}")
                for chunk in reply.iter_bytes():
                    data += chunk
                    if len(data) > MAX_IMAGE_BYTES:
                        raise ValueError(f"image URL {url[:200]!r} is larger than {MAX_IMAGE_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise ValueError(f"image URL {url[:200]!r} was not fetched within {FETCH_TIMEOUT_S:g} s")
        except (httpx.HTTPError, httpx.InvalidURL) as e:  # (InvalidURL is no HTTPError)
            raise ValueError(f"fetching image URL {url[:200]!r} failed: {type(e).__name__}: {e}") from None
        return bytes(data)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise ValueError("a data: image URL must be data:image/<type>;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"data: image URL is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a data: image URL's payload is not valid base64") from None


def decode_image(data: bytes, max_pixels: int | None = None):
    """Encoded bytes -> a loaded PIL image (RGB conversion is the image processor's); not an image,
    or an image of more than `max_pixels` (None: MAX_IMAGE_PIXELS), is a ValueError."""
    from PIL import Image  # optional dependency (nanoinfer[vision])
    limit = MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > limit:
                raise ValueError(f"the image is {image.width}x{image.height} pixels, more than {limit} (--max-image-pixels, "
                                 f"or what is left of the request's {MAX_REQUEST_PIXELS} pixels for all its images)")
            image.load()
            return image.copy()
    except ValueError:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, ...
        raise ValueError(f"the image URL's bytes are not a readable image: {type(e).__name__}: {e}") from None
