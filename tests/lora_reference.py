"""PEFT adapters made by the tests, and the HF + PEFT teacher-forced reference (float32, CPU)."""
import torch
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_MODELS = {}


def make_adapter(base_path: str, out_dir: str, target_modules=ALL_TARGETS, r: int = 8, lora_alpha: float = 16,
                 seed: int = 0, use_rslora: bool = False, std: float = 0.1) -> str:
    """A PEFT LoRA adapter of the checkpoint at `base_path`, saved to `out_dir`: random, nonzero A
    and B (PEFT would start B at zero, which changes nothing)."""
    from peft import LoraConfig, get_peft_model
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


def reference_model(base_path: str, adapter: str | None):
    """HF's model of `base_path`, with the PEFT adapter at `adapter` applied (None: the base)."""
    key = (base_path, adapter)
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, adapter)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def reference_logits(base_path: str, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(base_path, adapter)(input_ids=torch.tensor([token_ids])).logits[0].float()


def assert_greedy_matches(base_path: str, adapter: str | None, prompt_ids: list[int], completion: list[int],
                          tol: float = 1e-4):
    """At every generated position our token is the reference's argmax (or within `tol` of it)."""
    assert completion, "empty completion"
    logits = reference_logits(base_path, adapter, prompt_ids + completion)[len(prompt_ids) - 1:-1]
    ours = logits.gather(1, torch.tensor(completion)[:, None])[:, 0]
    gap = logits.max(-1).values - ours
    bad = (gap > tol).nonzero().flatten().tolist()
    assert not bad, f"adapter {adapter}: tokens differ from the reference argmax at positions {bad[:5]} " \
                    f"(logit gaps {gap[bad[:5]].tolist()})"


def differs_from(base_path: str, adapter: str, prompt_ids: list[int], completion: list[int]) -> bool:
    """Whether the adapter's greedy choice differs from the base's somewhere along this sequence
    (so that matching it proves the adapter was applied)."""
    ids = prompt_ids + completion
    a = reference_logits(base_path, adapter, ids)[len(prompt_ids) - 1:-1].argmax(-1)
    b = reference_logits(base_path, None, ids)[len(prompt_ids) - 1:-1].argmax(-1)
    return bool((a != b).any())
