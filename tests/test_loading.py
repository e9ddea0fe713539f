"""Checkpoint loading refuses what would load silently wrong: a missing shard of a fused weight, a
tensor whose shape disagrees with the config, a config with impossible sizes; and it loads a valid
checkpoint wherever it lives (glob characters in the path)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from nanoinfer.config import Config
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.model_build import ModelBuild, TensorParallel
from nanoinfer.models import get_model_class
from nanoinfer.utils.hf_files import load_eos_token_ids, load_tokenizer
from nanoinfer.utils.loader import load_model

LAYER = "model.layers.0."


def copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    """A copy of checkpoint `src` at `dst`, its tensors and config.json changed by the given functions."""
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load(path):
    hf = AutoConfig.from_pretrained(path)
    model = get_model_class(hf)(hf, ModelBuild())
    load_model(model, str(path))
    return model


def test_valid_checkpoint_loads_every_tensor(tiny_qwen3):
    model = load(tiny_qwen3)
    tensors = load_file(f"{tiny_qwen3}/model.safetensors")
    qkv = torch.cat([tensors[f"{LAYER}self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])


@pytest.mark.parametrize("name", [f"{LAYER}self_attn.q_proj.weight", f"{LAYER}self_attn.v_proj.weight",
                                  "model.layers.1.mlp.up_proj.weight", f"{LAYER}mlp.gate_proj.weight",
                                  f"{LAYER}input_layernorm.weight", "model.embed_tokens.weight"])
def test_missing_tensor_is_named(tiny_qwen3, tmp_path, name):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match="lacks.*" + name.replace(".", r"\.")):
        load(path)


def test_missing_bias_shard_is_named(make_checkpoint, tmp_path):
    name = f"{LAYER}self_attn.k_proj.bias"
    path = copy_checkpoint(make_checkpoint(arch="qwen2"), tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load(path)


def test_missing_shard_fails_through_llm(tiny_qwen3, tmp_path):
    from nanoinfer import LLM
    name = f"{LAYER}self_attn.q_proj.weight"
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        LLM(str(path))


def test_repeated_tensor_is_refused(tiny_qwen3, tmp_path):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, path / "model-extra.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*more than once"):
        load(path)


def _resize(name, shape):
    def edit(tensors):
        tensors[name] = torch.zeros(shape) if shape else torch.tensor(1.0)
    return edit


@pytest.mark.parametrize("name, shape, expected", [
    ("model.norm.weight", [1], [64]),                                   # copy_ would broadcast
    ("model.norm.weight", [], [64]),                                    # 0-d
    (f"{LAYER}self_attn.q_norm.weight", [32], [16]),
    (f"{LAYER}self_attn.q_proj.weight", [80, 64], [64, 64]),            # narrow would cut
    (f"{LAYER}self_attn.k_proj.weight", [32, 32], [32, 64]),
    (f"{LAYER}mlp.up_proj.weight", [160, 64], [128, 64]),
    (f"{LAYER}mlp.down_proj.weight", [64, 160], [64, 128]),
    (f"{LAYER}self_attn.o_proj.weight", [64, 64, 1], [64, 64]),
    ("model.embed_tokens.weight", [400, 64], [384, 64]),
])
def test_misshaped_tensor_is_named_with_both_shapes(tiny_qwen3, tmp_path, name, shape, expected):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", _resize(name, shape))
    with pytest.raises(ValueError) as err:
        load(path)
    msg = str(err.value)
    assert name in msg and str(expected) in msg and f"found {shape}" in msg


@pytest.mark.parametrize("field, value, tensor", [
    ("intermediate_size", 96, "mlp"),             # the checkpoint's MLP has 128
    ("vocab_size", 392, "embed_tokens"),          # the checkpoint's embedding has 384 rows
    ("head_dim", 8, "self_attn"),
])
def test_checkpoint_disagreeing_with_config_is_refused(tiny_qwen3, tmp_path, field, value, tensor):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", edit_config=lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=f"{tensor}.*size mismatch"):
        load(path)


@pytest.mark.parametrize("edit, match", [
    (dict(num_attention_heads=0), "num_attention_heads must be a positive int, got 0"),
    (dict(num_key_value_heads=-2), "num_key_value_heads must be a positive int"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(intermediate_size=0), "intermediate_size must be a positive int"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(num_hidden_layers=0, layer_types=[]), "num_hidden_layers must be a positive int"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),  # transformers' own validator, as a ValueError
    (dict(head_dim=0), "head_dim must be a positive int"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
    (dict(max_position_embeddings=1), "max_position_embeddings must be >= 2, got 1"),
])
def test_bad_config_sizes_are_refused_first(tiny_qwen3, tmp_path, edit, match):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=match):
        Config.from_options(str(path))


def test_glob_characters_in_path(tiny_qwen3, tmp_path):
    from nanoinfer import LLM, SamplingParams
    path = copy_checkpoint(tiny_qwen3, tmp_path / "qwen3-tiny[v2]")
    llm = LLM(str(path), num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64)
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 3
    finally:
        llm.exit()


def test_index_file_chooses_the_shards(tiny_qwen3, tmp_path):
    """A sharded checkpoint's model.safetensors.index.json says which files hold the model: other
    *.safetensors beside them (Mistral repos ship a consolidated.safetensors in another naming) are
    not read, as in HF and vLLM; a shard the index lists but the directory lacks is named."""
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    (path / "model.safetensors").unlink()
    save_file({k: tensors[k] for k in names[:half]}, path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[half:]}, path / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"layers.0.attention.wq.weight": tensors[f"{LAYER}self_attn.q_proj.weight"]},
              path / "consolidated.safetensors")
    model = load(path)
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors"):
        load(path)


# ---- tensor parallel: the full tensor's shape is checked before each rank cuts its shard ------------

def test_tp_shards_load_and_full_shapes_are_checked():
    full_q, full_kv = torch.randn(8, 6), torch.randn(4, 6)  # 4 query heads, 2 KV heads, head_dim 2
    build = ModelBuild(TensorParallel(1, 2))
    qkv = QKVParallelLinear(6, 2, 4, 2, build=build, prefix="qkv_proj")
    gate_up = MergedColumnParallelLinear(6, [4, 4], build=build, prefix="gate_up_proj")
    down = RowParallelLinear(4, 6, bias=True, build=build, prefix="down_proj")
    embed = VocabParallelEmbedding(10, 6, tp=build.tp)
    w = qkv.weight
    for shard, t in zip("qkv", (full_q, full_kv, 2 * full_kv)):
        w.weight_loader(w, t, shard)
    assert torch.equal(w, torch.cat([full_q[4:], full_kv[2:], 2 * full_kv[2:]]))
    with pytest.raises(ValueError, match=r"expected shape \[8, 6\].*found \[16, 6\]"):
        w.weight_loader(w, torch.randn(16, 6), "q")  # rank 1's slice exists, but the tensor is wrong
    gate = torch.randn(4, 6)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    assert torch.equal(gate_up.weight[:2], gate[2:])
    with pytest.raises(ValueError, match=r"expected shape \[4, 6\].*found \[6, 6\]"):
        gate_up.weight.weight_loader(gate_up.weight, torch.randn(6, 6), 1)
    full_down = torch.randn(6, 4)
    down.weight.weight_loader(down.weight, full_down)
    assert torch.equal(down.weight, full_down[:, 2:])
    down.bias.weight_loader(down.bias, torch.ones(6))  # the bias is not split
    with pytest.raises(ValueError, match=r"expected shape \[6, 4\].*found \[6, 8\]"):
        down.weight.weight_loader(down.weight, torch.randn(6, 8))
    full_embed = torch.randn(10, 6)
    embed.weight.weight_loader(embed.weight, full_embed)
    assert torch.equal(embed.weight, full_embed[5:])
    with pytest.raises(ValueError, match=r"expected shape \[10, 6\].*found \[12, 6\]"):
        embed.weight.weight_loader(embed.weight, torch.randn(12, 6))


# ---- the shard mechanism is generic: stacked experts with (expert, shard) ids ------------------------

class StackedExperts(nn.Module):
    """Two experts' gate and up projections stacked in one parameter, as a Mixture-of-Experts layer does;
    checkpoint tensors layer.experts.E.{gate,up}_proj.weight fill its shards (E, 0) and (E, 1)."""
    packed_modules_mapping = {f"experts.{e}.{p}_proj": ("experts.gate_up", (e, s))
                              for e in range(2) for s, p in enumerate(("gate", "up"))}

    def __init__(self):
        super().__init__()
        self.layer = nn.Module()
        self.layer.experts = nn.Module()
        self.layer.experts.gate_up = nn.Module()
        w = self.layer.experts.gate_up.weight = nn.Parameter(torch.zeros(2, 2, 3), requires_grad=False)
        w.shard_ids = [(e, s) for e in range(2) for s in range(2)]
        w.weight_loader = lambda param, loaded, shard: param.data[shard].copy_(loaded)


def test_generic_shard_ids_every_one_accounted_for(tmp_path):
    tensors = {f"layer.experts.{e}.{p}_proj.weight": torch.full((3,), 10.0 * e + s)
               for e in range(2) for s, p in enumerate(("gate", "up"))}
    (tmp_path / "full").mkdir()
    save_file(tensors, tmp_path / "full" / "model.safetensors")
    model = StackedExperts()
    load_model(model, str(tmp_path / "full"))
    assert model.layer.experts.gate_up.weight[:, :, 0].tolist() == [[0, 1], [10, 11]]

    del tensors["layer.experts.1.up_proj.weight"]
    (tmp_path / "partial").mkdir()
    save_file(tensors, tmp_path / "partial" / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks.*'layer\.experts\.1\.up_proj\.weight'"):
        load_model(StackedExperts(), str(tmp_path / "partial"))


# ---- tokenizer and EOS ids (utils/hf_files.py) -------------------------------------------------------

def without_tokenizer(src, dst):
    """The checkpoint with its config, weights and generation_config but no tokenizer files."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f"{src}/{name}", dst)
    return dst


def test_checkpoint_without_tokenizer_is_refused(tiny_qwen3, tmp_path):
    """transformers hands back a one-token tokenizer for such a directory (replaces the old
    test_bad_model_paths case, whose error came from the missing safetensors, not the tokenizer)."""
    path = without_tokenizer(tiny_qwen3, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="no usable tokenizer.*1 token"):
        load_tokenizer(str(path))
    assert len(load_tokenizer(tiny_qwen3)) > 1


def test_tokenizer_needing_custom_code_is_refused_without_prompting(tiny_qwen3, tmp_path, monkeypatch):
    prompts = []
    monkeypatch.setattr("builtins.input", lambda *a: prompts.append(a) or "n")
    path = copy_checkpoint(tiny_qwen3, tmp_path / "custom", edit_config=lambda c: c.update(
        model_type="my_custom_lm", auto_map={"AutoConfig": "configuration_custom.MyConfig"}))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["tokenization_custom.MyTokenizer", None]})
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="could not load a tokenizer.*runs no code"):
        load_tokenizer(str(path))
    assert prompts == []


def test_eos_ids_from_tokenizer_and_generation_config(tiny_qwen3, tmp_path):
    tokenizer = load_tokenizer(tiny_qwen3)
    eos, endoftext = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert load_eos_token_ids(tiny_qwen3, tokenizer) == frozenset({eos, endoftext})
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_eos_token_ids(str(path), tokenizer) == frozenset({eos, 7})
    (path / "generation_config.json").unlink()
    assert load_eos_token_ids(str(path), tokenizer) == frozenset({eos})
    tokenizer.eos_token = None  # EOS stated only in generation_config.json is enough
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert load_eos_token_ids(str(path), tokenizer) == frozenset({5, 6})


@pytest.mark.parametrize("text, match", [
    ("{not json", "could not read"),
    ('{"eos_token_id": "2"}', "eos_token_id must be an int or a list of ints, got '2'"),
    ('{"eos_token_id": [2, "3"]}', "eos_token_id must be an int or a list of ints"),
    ('{"eos_token_id": true}', "eos_token_id must be an int or a list of ints"),
    ('{"eos_token_id": 2.0}', "eos_token_id must be an int or a list of ints"),
    ("[2, 3]", "must hold a JSON object, got a list"),
    ('{"eos_token_id": 100000}', r"EOS token id\(s\) \[100000\].*outside the tokenizer's vocabulary \[0, 384\)"),
    ('{"eos_token_id": -1}', r"EOS token id\(s\) \[-1\]"),
    (b"\xff\xfe{}", "could not read"),
])
def test_bad_generation_config_is_named(tiny_qwen3, tmp_path, text, match):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    gen = path / "generation_config.json"
    gen.write_bytes(text) if isinstance(text, bytes) else gen.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_eos_token_ids(str(path), load_tokenizer(str(path)))
    assert "generation_config.json" in str(err.value)


def test_no_eos_at_all_is_refused(tiny_qwen3, tmp_path):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    tokenizer = load_tokenizer(str(path))
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        load_eos_token_ids(str(path), tokenizer)


# ---- end to end: the engine loads its tokenizer and EOS ids through utils/hf_files.py ----------------

def test_llm_refuses_a_checkpoint_without_tokenizer(tiny_qwen3, tmp_path):
    from nanoinfer import LLM
    with pytest.raises(ValueError, match="no usable tokenizer"):
        LLM(str(without_tokenizer(tiny_qwen3, tmp_path / "ckpt")))


def test_llm_refuses_a_bad_generation_config(tiny_qwen3, tmp_path):
    from nanoinfer import LLM
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    (path / "generation_config.json").write_text('{"eos_token_id": "2"}')
    with pytest.raises(ValueError, match=r"generation_config\.json.*eos_token_id"):
        LLM(str(path))


def test_llm_takes_its_tokenizer_from_the_tokenizer_option(tiny_qwen3, tmp_path):
    from nanoinfer import LLM
    path = without_tokenizer(tiny_qwen3, tmp_path / "ckpt")
    llm = LLM(str(path), tokenizer=tiny_qwen3, num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64)
    try:
        assert llm.tokenizer.decode(llm.tokenizer.encode("Hello")) == "Hello"
    finally:
        llm.exit()
