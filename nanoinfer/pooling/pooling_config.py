"""How a checkpoint pools: read from its sentence-transformers files when it has them.

`modules.json` lists the modules; its `sentence_transformers.models.Pooling` entry names a folder
(usually `1_Pooling`) whose `config.json` sets one `pooling_mode_*` flag.
Modules other than the Transformer, the Pooling and Normalize (a Dense projection after the
pooling, ...) and a pooling without the prompt's tokens (`include_prompt: false`) are refused.
Without these files: the last token (vLLM's default for decoder embedding models such as
Qwen3-Embedding). Embeddings are normalised unless PoolingParams(normalize=False), whatever the
files say, as in vLLM."""
import json
import os

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers modules whose effect we reproduce (the backbone, the pooling, the
# normalisation, which PoolingParams.normalize governs)
_RUN_MODULES = ("Transformer", "Pooling", "Normalize")
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
    for m in modules:  # steps that change the embedding and that we do not run: refused, not skipped
        kind = str(m.get("type", "")).rpartition(".")[2]
        if kind not in _RUN_MODULES:
            raise ValueError(f"{modules_path!r}: module {m.get('path', m.get('name'))!r} ({m.get('type')}) is not "
                             f"supported; nanoinfer runs {', '.join(_RUN_MODULES)} modules only")
    pooling = next((m for t, m in types.items() if t.endswith("models.Pooling")), None)
    if pooling is None:
        return "LAST"
    config_path = os.path.join(model_dir, pooling.get("path", "1_Pooling"), "config.json")
    try:
        with open(config_path) as f:
            flags = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {config_path!r} (the sentence-transformers pooling config): {e}") from e
    if flags.get("include_prompt", True) is not True:
        raise ValueError(f"{config_path!r}: include_prompt={flags['include_prompt']!r} (pooling without the "
                         "instruction's tokens) is not supported")
    on = [name for name, value in flags.items() if name.startswith("pooling_mode") and value is True]
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"{config_path!r} asks for pooling {on}; nanoinfer pools with exactly one of "
                         f"{sorted(_MODES)}")
    return _MODES[on[0]]
