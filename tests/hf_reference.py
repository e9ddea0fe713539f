"""Teacher-forced comparison against Hugging Face transformers (float32, CPU)."""
import torch
from transformers import AutoModelForCausalLM

_MODELS = {}


def hf_model(path: str):
    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]


def assert_greedy_matches_hf(path: str, prompt_ids: list[int], completion: list[int], tol: float = 1e-5):
    """Feed prompt + our completion through HF once; at every generated position our token must be
    HF's argmax, or within `tol` of the max logit (a tie)."""
    assert completion, "empty completion"
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = hf_model(path)(ids).logits[0, len(prompt_ids) - 1:-1].float()
    ours = logits.gather(1, torch.tensor(completion)[:, None])[:, 0]
    gap = logits.max(-1).values - ours
    bad = (gap > tol).nonzero().flatten().tolist()
    assert not bad, f"tokens differ from HF argmax at completion positions {bad[:5]} (logit gaps {gap[bad[:5]].tolist()})"
