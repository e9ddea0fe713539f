"""The checkpoint's tokenizer and EOS ids, read without running any code from the checkpoint and
refused (ValueError naming the file) when unusable instead of loading something silently wrong."""
import json
import os
from numbers import Integral

from transformers import AutoTokenizer


def load_tokenizer(path: str):
    """The tokenizer of `path`. transformers hands back a one-token tokenizer for a directory without
    tokenizer files; that is refused, as is a tokenizer that needs custom code (auto_map)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r} (nanoinfer runs no code from a "
                         f"checkpoint: trust_remote_code=False): {e}") from e
    if len(tokenizer) <= 1:
        raise ValueError(f"no usable tokenizer in {path!r}: its vocabulary has {len(tokenizer)} token(s) "
                         "(tokenizer.json / tokenizer_config.json missing?)")
    return tokenizer


def load_eos_token_ids(path: str, tokenizer) -> frozenset[int]:
    """The tokenizer's EOS plus every eos_token_id (an int or a list of ints) of the checkpoint's
    generation_config.json; at least one, each a token of the tokenizer."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            raise ValueError(f"could not read {gen_path!r}: {e}") from e
        if not isinstance(gen, dict):
            raise ValueError(f"{gen_path!r} must hold a JSON object, got a {type(gen).__name__}")
        eos = gen.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in eos):
            raise ValueError(f"{gen_path!r}: eos_token_id must be an int or a list of ints, "
                             f"got {gen['eos_token_id']!r}")
        bad = [t for t in eos if not 0 <= t < len(tokenizer)]
        if bad:
            raise ValueError(f"{gen_path!r}: EOS token id(s) {bad} are outside the tokenizer's vocabulary "
                             f"[0, {len(tokenizer)})")
        ids.update(int(t) for t in eos)
    if not ids:
        raise ValueError(f"no EOS token for {path!r}: the tokenizer has none and generation_config.json "
                         "states no eos_token_id")
    return frozenset(ids)
