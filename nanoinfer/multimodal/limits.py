"""`limit_mm_per_prompt`, vLLM's option: at most N items of a modality in one prompt, e.g.
{"image": 2}; 0 refuses that modality. Given as a dict, or as its JSON text on the command line.
Videos and audio are not supported whatever their limit; their keys are accepted so that vLLM
scripts that set them (often to 0) run unchanged."""
from collections.abc import Mapping
from numbers import Integral

from nanoinfer.utils.dict_option import dict_option

MODALITIES = ("image", "video", "audio")


def parse_mm_limits(value) -> dict[str, int] | None:
    """The validated limits, or None (no limit). Every problem is a ValueError / TypeError naming
    limit_mm_per_prompt and the key."""
    if value is None:
        return None
    value = dict_option("limit_mm_per_prompt", value, "{'image': 2}")
    limits = {}
    for key, n in value.items():
        if key not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt has unknown modality {key!r}; valid ones are {list(MODALITIES)}")
        if isinstance(n, Mapping) and "count" in n:  # vLLM also takes {"image": {"count": 2, ...}}
            n = n["count"]
        if isinstance(n, bool) or not isinstance(n, Integral):
            raise TypeError(f"limit_mm_per_prompt[{key!r}] must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}] must be >= 0, got {n}")
        limits[key] = int(n)
    return limits


def check_item_count(limits: dict[str, int] | None, modality: str, count: int):
    """A prompt with more items of `modality` than its limit is a ValueError."""
    if limits is not None and modality in limits and count > limits[modality]:
        raise ValueError(f"the prompt has {count} {modality}(s); limit_mm_per_prompt allows at most "
                         f"{limits[modality]} per prompt")
