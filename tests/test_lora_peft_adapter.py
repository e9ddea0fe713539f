"""Reading PEFT adapters (lora/peft_adapter.py, lora/intake.py) and the LoRA API's bad input: every
bad adapter or option is a ValueError/TypeError naming the tensor, file or field, raised before
anything is queued, and the engine keeps serving."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.lora.targets import check_lora_model

from lora_reference import make_adapter

OPTIONS = dict(kvcache_block_size=16, max_model_len=96, num_kvcache_blocks=32)
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def base(make_checkpoint):
    return make_checkpoint()


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return make_adapter(base, str(tmp_path_factory.mktemp("good")), r=8)


@pytest.fixture(scope="module")
def llm(base):
    engine = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **OPTIONS)
    yield engine
    engine.exit()


def variant(good, tmp_path, name, tensors=None, config=None):
    """A copy of the good adapter with its tensors and/or config changed."""
    path = tmp_path / name
    shutil.copytree(good, path)
    if tensors is not None:
        weights = load_file(os.path.join(good, "adapter_model.safetensors"))
        tensors(weights)  # (changes them in place)
        save_file(weights, str(path / "adapter_model.safetensors"))
    if config is not None:
        with open(path / "adapter_config.json") as f:
            cfg = json.load(f)
        config(cfg)
        with open(path / "adapter_config.json", "w") as f:
            json.dump(cfg, f)
    return str(path)


def expect_refused(llm, path, match, lora_id=100):
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=[None, LoRARequest("bad", lora_id, path)])
    assert not llm.requests and llm.is_finished(), "nothing was queued"


def test_bad_adapters_name_the_tensor(llm, base, good, tmp_path):
    cases = [
        ("lm_head", lambda w: w.update({"base_model.model.lm_head.lora_A.weight": torch.ones(8, 64)}),
         r"base_model\.model\.lm_head\.lora_A\.weight.*unsupported target module"),
        ("embedding", lambda w: w.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 4)}),
         r"embed_tokens.*unsupported target module"),
        ("layer", lambda w: w.update({KEY.replace("layers.0", "layers.7"): w[KEY].clone()}),
         r"layers\.7.*layer 7 does not exist"),
        ("shape", lambda w: w.update({KEY: torch.ones(8, 32)}), r"q_proj\.lora_A\.weight: shape \[8, 32\].*\[8, 64\]"),
        ("missing", lambda w: w.pop(KEY.replace("lora_A", "lora_B")), r"q_proj\.lora_B\.weight is missing"),
        ("nan", lambda w: w[KEY].__setitem__((0, 0), float("nan")), r"q_proj\.lora_A\.weight.* NaN"),
        ("int", lambda w: w.update({KEY: w[KEY].to(torch.int32)}), r"q_proj\.lora_A\.weight.*floating-point"),
    ]
    for i, (name, change, match) in enumerate(cases):
        expect_refused(llm, variant(good, tmp_path, name, tensors=change), match, 100 + i)


def test_too_high_a_rank_is_refused(llm, base, tmp_path):
    path = make_adapter(base, str(tmp_path / "r16"), ["v_proj"], r=16)
    expect_refused(llm, path, r"v_proj\.lora_A\.weight: rank 16 exceeds max_lora_rank=8")


def test_an_adapter_of_another_base_is_refused(llm, make_checkpoint, tmp_path):
    other = make_checkpoint(hidden_size=32, intermediate_size=64)
    path = make_adapter(other, str(tmp_path / "other"), ["gate_proj"], r=4)
    expect_refused(llm, path, r"gate_proj\.lora_A\.weight: shape \[4, 32\] does not match the base model's")


def test_bad_adapter_configs_name_the_field(llm, good, tmp_path):
    cases = [("dora", lambda c: c.update(use_dora=True), "use_dora"),
             ("bias", lambda c: c.update(bias="all"), "bias='all'"),
             ("save", lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
             ("alpha", lambda c: c.update(alpha_pattern={"q_proj": 3}), "alpha_pattern"),
             ("r", lambda c: c.update(r=0), "r must be a positive int"),
             ("rank", lambda c: c.update(r=4), r"rank 8 differs from the config's r=4"),
             ("type", lambda c: c.update(peft_type="IA3"), "peft_type 'IA3'")]
    for i, (name, change, match) in enumerate(cases):
        expect_refused(llm, variant(good, tmp_path, name, config=change), match, 200 + i)
    no_config = variant(good, tmp_path, "noconfig")
    os.remove(os.path.join(no_config, "adapter_config.json"))
    expect_refused(llm, no_config, "has no adapter_config.json", 300)
    expect_refused(llm, str(tmp_path / "nowhere"), "is not a directory", 301)


VARIANTS = [("alora_invocation_tokens", [5, 6]),  # aLoRA: the adapter applies only after these tokens
            ("layer_replication", [[1, 2], [0, 1]]),  # the base's layers reordered / repeated
            ("arrow_config", {"top_k": 2}), ("kasa_config", {"alpha": 1}), ("velora_config", {"num_groups": 2}),
            ("monteclora_config", {"n": 2}), ("use_bdlora", {"nblocks": 2}), ("use_qalora", True)]


@pytest.mark.parametrize("field,value", VARIANTS)
def test_lora_variants_that_change_the_product_are_refused(llm, good, tmp_path, field, value):
    """PEFT options whose forward is not x @ A^T @ B^T * scale (with vanilla-looking tensors): applying
    the tensors as plain LoRA would differ from PEFT silently."""
    path = variant(good, tmp_path, "variant", config=lambda c: c.update({field: value}))
    expect_refused(llm, path, f"adapter_config.json: {field}=.* not supported", 400 + VARIANTS.index((field, value)))


def test_bad_requests_and_options(llm, base, good, tmp_path):
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate("Hello", sp, use_tqdm=False, lora_request="ad")
    with pytest.raises(ValueError, match="got 1 lora_request entries for 2 prompts"):
        llm.generate(["Hello", "Hi"], sp, use_tqdm=False, lora_request=[LoRARequest("a", 1, good)])
    llm.generate("Hello", sp, use_tqdm=False, lora_request=LoRARequest("a", 1, good))
    other = variant(good, tmp_path, "copy")
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter"):
        llm.generate("Hello", sp, use_tqdm=False, lora_request=LoRARequest("b", 1, other))
    with pytest.raises(ValueError, match="lora_int_id must be > 0"):
        LoRARequest("a", 0, good)
    with pytest.raises(TypeError, match="lora_name"):
        LoRARequest("", 1, good)
    assert not llm.requests
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False,
                       lora_request=LoRARequest("a", 1, good))[0]
    assert len(out.outputs[0].token_ids) == 3, "the engine keeps serving"
    plain = LLM(base, **OPTIONS)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate("Hello", sp, use_tqdm=False, lora_request=LoRARequest("a", 1, good))
    finally:
        plain.exit()
    with pytest.raises(ValueError, match="max_cpu_loras must be >= 2"):
        LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=1, **OPTIONS)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(base, enable_lora=True, max_lora_rank=0, **OPTIONS)
    with pytest.raises(ValueError, match="enable_lora: adapters are supported for"):
        check_lora_model(PretrainedConfig(architectures=["Qwen3MoeForCausalLM"]))


def test_tensor_names_without_peft_prefix_load_the_same_adapter(llm, good, tmp_path):
    """Adapters written by other tools name their tensors without PEFT's base_model.model. prefix,
    over a base saved without "model.", or with PEFT's adapter name (lora_A.default.weight): they
    are the same adapter (same greedy tokens as the PEFT-named one). One module named twice is refused."""
    renames = {"bare": lambda k: k.replace("base_model.model.", ""),
               "base": lambda k: k.replace("base_model.model.model.", "base_model.model."),
               "default": lambda k: k.replace(".weight", ".default.weight")}
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(["Hello there"], sp, use_tqdm=False, lora_request=LoRARequest("good", 1, good))
    for i, (name, rename) in enumerate(renames.items()):
        def change(w, rename=rename):
            renamed = {rename(k): v for k, v in w.items()}
            w.clear()
            w.update(renamed)
        path = variant(good, tmp_path, name, tensors=change)
        got = llm.generate(["Hello there"], sp, use_tqdm=False, lora_request=LoRARequest(name, 10 + i, path))
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, name
    twice = variant(good, tmp_path, "twice", tensors=lambda w: w.update({KEY.replace("base_model.model.", ""): w[KEY].clone()}))
    expect_refused(llm, twice, r"names the same module and half as another tensor", 20)
