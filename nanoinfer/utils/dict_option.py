"""Options that are dicts in Python and their JSON text on the command line (vLLM's
speculative_config, limit_mm_per_prompt, ...)."""
import json
from collections.abc import Mapping


def dict_option(name: str, value, example: str) -> Mapping:
    """`value` (a mapping, or its JSON text) as a mapping; else a ValueError / TypeError naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict like {example}, got {type(value).__name__}")
    return value
