"""The LoRA weight method (lora/linear.py) on single layers: rows without an adapter (slot -1, as
CUDA-graph padding and base rows are) get exactly the base product; rows with one get base + x A^T
B^T * scale of their slot; a fused layer's shards sit in their own rank blocks and output rows; a
slot reloaded with an adapter of fewer targets keeps nothing of the previous one; each token of a
mixed step gets its row's slot."""
import torch

from nanoinfer.engine.forward_inputs import prepare_inputs
from nanoinfer.lora.feature import LoRARankFeature
from nanoinfer.lora.slot_table import LORA, LoRAStep, token_slots
from nanoinfer.step.step_message import StepInput
from nanoinfer.layers.linear import QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.linear_method import dense_linear_method
from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.lora.linear import lora_method_chooser
from nanoinfer.models.qwen3 import Qwen3ForCausalLM
from nanoinfer.utils.context import get_context, reset_context, set_context

PACKED = Qwen3ForCausalLM.packed_modules_mapping


def build(cls, *args, prefix):
    torch.manual_seed(0)
    choose = lora_method_chooser(dense_linear_method, PACKED, num_slots=3, max_rank=4)
    layer = cls(*args, build=ModelBuild(linear_method=choose), prefix=prefix)
    layer.weight.data.normal_()
    return layer


def run(layer, x, slots):
    set_context(lora_slots=None if slots is None else torch.tensor(slots))
    try:
        return layer(x)
    finally:
        reset_context()


def test_rows_get_their_slots_adapter_and_base_rows_the_exact_base_product():
    layer = build(QKVParallelLinear, 16, 4, 2, 1, prefix="model.layers.0.self_attn.qkv_proj")
    method = layer.method
    a_q, b_q, a_v, b_v = torch.randn(3, 16), torch.randn(8, 3), torch.randn(2, 16), torch.randn(4, 2)
    method.write_shard(layer, 1, 0, a_q, b_q, 0.5)   # q of slot 1
    method.write_shard(layer, 1, 2, a_v, b_v, 2.0)   # v of slot 1
    method.write_shard(layer, 2, 1, torch.randn(4, 16), torch.randn(4, 4), 1.0)  # k of slot 2
    x = torch.randn(4, 16)
    base = x @ layer.weight.t()
    y = run(layer, x, [-1, 1, -1, 0])
    assert torch.equal(y[[0, 2, 3]], base[[0, 2, 3]]), "base rows and an empty slot add exactly nothing"
    assert torch.equal(run(layer, x, None), base)
    expected = base[1].clone()
    expected[:8] += (x[1] @ a_q.t()) @ b_q.t() * 0.5
    expected[12:] += (x[1] @ a_v.t()) @ b_v.t() * 2.0
    torch.testing.assert_close(y[1], expected)
    method.clear_slot(layer, 1)
    assert torch.equal(run(layer, x, [1, 1, 1, 1]), base), "a cleared slot holds nothing"


def test_the_expand_kernel_path_gives_the_torch_paths_result(monkeypatch):
    """The layer with its expand in the Triton kernel (CUDA's path; here the interpreter)."""
    layer = build(QKVParallelLinear, 16, 4, 2, 1, prefix="model.layers.0.self_attn.qkv_proj")
    for slot, shard in ((0, 0), (1, 2), (2, 1), (2, 0)):
        layer.method.write_shard(layer, slot, shard, torch.randn(4, 16), torch.randn(8 if shard == 0 else 4, 4), 0.7)
    x = torch.randn(6, 16)
    slots = [-1, 0, 2, 1, 2, -1]
    expected = run(layer, x, slots)
    monkeypatch.setattr("nanoinfer.lora.linear.expand_kernel_for", lambda y: True)
    got = run(layer, x, slots)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # rows of the base model get the layer's base product + exactly 0 (over a dense base the product
    # is the joint one, base columns and shrink together)
    base = (x @ layer.weight_and_lora_a.t())[:, :layer.weight.shape[0]]
    assert torch.equal(got[[0, 5]], base[[0, 5]])
    torch.testing.assert_close(base, x @ layer.weight.t(), rtol=1e-6, atol=1e-6)


def test_a_deferred_row_reaches_the_shrink_normalised(monkeypatch):
    """One row on CUDA arrives as a Deferred (its RMSNorm or SiLU * mul left to the GEMV): the LoRA
    layer's base GEMV and its shrink GEMV both apply it (here under the interpreter: the one-row
    rule is widened to CPU inputs)."""
    from nanoinfer.layers import linear_method
    from nanoinfer.layers.layernorm import add_rms_norm
    from nanoinfer.layers.linear_method import Deferred
    monkeypatch.setattr(linear_method, "takes_gemv", lambda x: x.shape[0] == 1 and x.is_contiguous())
    layer = build(QKVParallelLinear, 16, 4, 2, 1, prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.takes_deferred(torch.randn(1, 16)), "as its dense base"
    assert not layer.takes_deferred(torch.randn(2, 16)), "a few rows on CPU: no fusing kernel"
    layer.method.write_shard(layer, 1, 0, torch.randn(4, 16), torch.randn(8, 4), 1.5)
    x, res, w = torch.randn(1, 16), torch.randn(1, 16), torch.rand(16) + 0.5
    normed, new_res = add_rms_norm(x, res, w, 1e-6)
    expected = run(layer, normed, [1])
    residual_out = torch.empty_like(res)
    got = run(layer, Deferred(x, w, 1e-6, res, residual_out), [1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual_out, new_res)
    down = build(RowParallelLinear, 8, 6, prefix="model.layers.0.mlp.down_proj")
    down.method.write_shard(down, 0, 0, torch.randn(4, 8), torch.randn(6, 4), 0.5)
    gate_up = torch.randn(1, 16)
    from nanoinfer.layers.activation import silu_and_mul
    torch.testing.assert_close(run(down, Deferred(gate_up, silu_mul=True), [0]), run(down, silu_and_mul(gate_up), [0]),
                               rtol=1e-5, atol=1e-5)


def test_a_row_parallel_layer_adds_its_adapter_into_the_given_output():
    layer = build(RowParallelLinear, 8, 6, prefix="model.layers.1.mlp.down_proj")
    a, b = torch.randn(4, 8), torch.randn(6, 4)
    layer.method.write_shard(layer, 0, 0, a, b, 1.5)
    x, out = torch.randn(2, 8), torch.empty(2, 6)
    set_context(lora_slots=torch.tensor([0, -1]))
    try:
        y = layer.method.apply(layer, x, out=out)
    finally:
        reset_context()
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y[0], x[0] @ layer.weight.t() + (x[0] @ a.t()) @ b.t() * 1.5)
    assert torch.equal(y[1], (x @ layer.weight_and_lora_a.t())[1, :6]), "the base row: its product + exactly 0"


def test_each_token_of_a_mixed_step_gets_its_rows_slot():
    step = StepInput(num_decode=1, starts=[5, 0, 0], query_lens=[1, 3, 2], input_ids=[1, 2, 3, 4, 5, 6],
                     block_tables=[[0], [1], [2]], parts={LORA: LoRAStep([2, -1, 0], [])})
    try:
        prepare_inputs(step, 16, torch.device("cpu"), False, None, fields={"lora_slots": token_slots(step, step.part(LORA))})
        assert get_context().lora_slots.tolist() == [2, -1, -1, -1, 0, 0]
    finally:
        reset_context()
    step = StepInput(num_decode=2, starts=[5, 7], query_lens=[1, 1], input_ids=[1, 2], block_tables=[[0], [1]],
                     parts={LORA: LoRAStep([-1, 1], [])})
    try:
        prepare_inputs(step, 16, torch.device("cpu"), False, None, fields={"lora_slots": token_slots(step, step.part(LORA))})
        assert get_context().lora_slots.tolist() == [-1, 1]
    finally:
        reset_context()


def test_graph_buffers_hold_each_tokens_slot_and_pad_with_the_base():
    """What a CUDA-graph replay reads (engine/graph_runner.py): the step's slots, then -1 for the
    padded tokens; a step without adapters leaves no slot of an earlier step behind."""
    from nanoinfer.engine.graph_runner import GraphRunner
    from nanoinfer.utils.context import Context
    runner = GraphRunner(None, 8, 64, 4, 16, torch.float32, torch.device("cpu"), mixed_steps=False,
                         sorts_decode_rows=False, graph_inputs=LoRARankFeature.graph_inputs)
    g = runner._allocate_buffers(8)
    ids, pos = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    runner._fill_tokens(g, ids, pos, Context(slot_mapping=torch.arange(3), lora_slots=torch.tensor([1, -1, 0])))
    assert g["lora_slots"].tolist() == [1, -1, 0, -1, -1, -1, -1, -1]
    runner._fill_tokens(g, ids, pos, Context(slot_mapping=torch.arange(3)))
    assert g["lora_slots"].tolist() == [-1] * 8
