"""`speculative_config`, vLLM's dict, validated once: every field named in its error."""
from dataclasses import dataclass
from numbers import Integral, Real

from nanoinfer.utils.dict_option import dict_option

MAX_SPECULATIVE_TOKENS = 16  # a verify row is k + 1 query tokens; more is never worth it
DEFAULT_PROMPT_LOOKUP = 5
FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
          "disable_by_batch_size", "disable_below_acceptance")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup) or "draft_model" (a smaller model with the same vocabulary).
    disable_by_batch_size (vLLM's): no proposals while more sequences than this are running.
    disable_below_acceptance (nanoinfer's): a sequence whose running acceptance rate falls below
    it gets no more proposals (0 keeps speculating)."""
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None
    disable_below_acceptance: float = 0.0

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A dict (or its JSON text, as the server flag gives it), or None: no speculation."""
        if value is None or isinstance(value, cls):
            return value
        value = dict_option("speculative_config", value, "{'method': 'ngram', 'num_speculative_tokens': 3}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; valid fields are {list(FIELDS)}")
        return cls._from_fields(dict(value))

    @classmethod
    def _from_fields(cls, d: dict) -> "SpeculativeConfig":
        model = d.get("model")
        if model is not None and not isinstance(model, str):
            raise TypeError(f"speculative_config['model'] must be a path, got {type(model).__name__}")
        method = d.get("method") or ("draft_model" if model is not None else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config['method'] must be 'ngram' or 'draft_model' (or give 'model'), "
                             f"got {d.get('method')!r}")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        if method == "draft_model" and model is None:
            raise ValueError("speculative_config['model'] is required for method 'draft_model'")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config['num_speculative_tokens'] is required")
        k = _int(d, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        lo = hi = DEFAULT_PROMPT_LOOKUP
        if method == "ngram":
            hi = _int(d, "prompt_lookup_max", 1, 1024) if d.get("prompt_lookup_max") is not None else None
            lo = _int(d, "prompt_lookup_min", 1, 1024) if d.get("prompt_lookup_min") is not None else None
            hi, lo = hi or lo or DEFAULT_PROMPT_LOOKUP, lo or hi or DEFAULT_PROMPT_LOOKUP
            if lo > hi:
                raise ValueError(f"speculative_config['prompt_lookup_min']={lo} exceeds prompt_lookup_max={hi}")
        elif d.get("prompt_lookup_max") is not None or d.get("prompt_lookup_min") is not None:
            raise ValueError("speculative_config: prompt_lookup_max / prompt_lookup_min are for method 'ngram'")
        batch = _int(d, "disable_by_batch_size", 1, None) if d.get("disable_by_batch_size") is not None else None
        accept = d.get("disable_below_acceptance", 0.0)
        if not isinstance(accept, Real) or isinstance(accept, bool):
            raise TypeError("speculative_config['disable_below_acceptance'] must be a float, "
                            f"got {type(accept).__name__}")
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"speculative_config['disable_below_acceptance'] must be in [0, 1], got {accept}")
        return cls(method, k, model, hi, lo, batch, float(accept))


def _int(d: dict, name: str, low: int, high: int | None) -> int:
    value = d[name]
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(f"speculative_config['{name}'] must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config['{name}'] must be {bound}, got {value}")
    return int(value)
