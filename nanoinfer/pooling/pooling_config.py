"""How a checkpoint pools: read from its sentence-transformers files when it has them.

`modules.json` lists the modules; its `sentence_transformers.models.Pooling` entry names a folder
(usually `1_Pooling`) whose `config.json` sets one `pooling_mode_*` flag.
Without these files: the last token (vLLM's default for decoder embedding models such as
Qwen3-Embedding). Embeddings are normalised unless PoolingParams(normalize=False), whatever the
files say, as in vLLM."""
import json
import os

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


def read_pooling_type(model_dir: str) -> str:
    """The checkpoint's pooling (see the module's text). A Pooling module asking for a mode we lack
    (max, weighted mean, ...) is a ValueError naming it: nothing pools silently wrong."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return "LAST"
    try:
        with open(modules_path) as f:
            modules = json.load(f)
        types = {m.get("type", ""): m for m in modules}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"could not read {modules_path!r} (sentence-transformers modules): {e}") from e
    pooling = next((m for t, m in types.items() if t.endswith("models.Pooling")), None)
    if pooling is None:
        return "LAST"
    config_path = os.path.join(model_dir, pooling.get("path", "1_Pooling"), "config.json")
    try:
        with open(config_path) as f:
            flags = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {config_path!r} (the sentence-transformers pooling config): {e}") from e
    on = [name for name, value in flags.items() if name.startswith("pooling_mode") and value is True]
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"{config_path!r} asks for pooling {on}; nanoinfer pools with exactly one of "
                         f"{sorted(_MODES)}")
    return _MODES[on[0]]
