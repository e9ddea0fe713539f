import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.step.step_message import StepInput
from nanoinfer.engine.forward_inputs import SHORT_ROWS_MAX_QUERY, prepare_inputs
from nanoinfer.engine.graph_runner import graph_batch_sizes
from nanoinfer.utils.context import Context, get_context


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 15, 16, 17, 100, 256, 512])
def test_graph_buckets_cover_every_batch_size(max_num_seqs):
    buckets = graph_batch_sizes(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        bucket = next(b for b in buckets if b >= n)
        assert bucket - n < 16  # padding stays small


def test_context_is_cleared_after_every_forward(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64)
    try:
        llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
        while not llm.is_finished():
            llm.step()
            assert get_context() == Context()
    finally:
        llm.exit()


def test_slot_mapping_and_block_tables(tiny_qwen3):
    """Inputs the runner builds for a prefill chunk over a cached prefix, a decode row, a decode row
    whose token is still on the device, and a mixed step (decode rows first)."""
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64)
    try:
        runner = llm.model_runner

        def prepare(step, prev_tokens=None):
            return prepare_inputs(step, 16, runner.device, False, prev_tokens)

        table = [7, 2, 5]
        tokens = list(range(1, 41))
        input_ids, positions = prepare(StepInput(0, [16], [20], tokens[16:36], [table]))  # positions 16..35
        ctx = get_context()
        assert ctx.is_prefill
        assert input_ids.tolist() == list(range(17, 37)) and positions.tolist() == list(range(16, 36))
        assert ctx.slot_mapping.tolist() == [2 * 16 + i for i in range(16)] + [5 * 16 + i for i in range(4)]
        assert ctx.cu_seqlens_q.tolist() == [0, 20] and ctx.context_lens.tolist() == [36]
        assert ctx.block_tables.tolist() == [[7, 2, 5]]
        input_ids, positions = prepare(StepInput(1, [39], [1], [40], [table]))  # the last of 40 tokens
        ctx = get_context()
        assert not ctx.is_prefill
        assert input_ids.tolist() == [40] and positions.tolist() == [39]
        assert ctx.slot_mapping.tolist() == [5 * 16 + 7] and ctx.context_lens.tolist() == [40]
        # an in-flight token (row 1 of the step before): position 40
        input_ids, _ = prepare(StepInput(1, [40], [1], [0], [table], [0], [1]), torch.tensor([11, 41]))
        assert get_context().slot_mapping.tolist() == [5 * 16 + 8] and input_ids.tolist() == [41]
        # few short rows (two decode rows, then a 3-token chunk of a prompt in block 9): a decode row a token
        input_ids, positions = prepare(StepInput(2, [39, 3, 0], [1, 1, 3], [40, 4, 5, 6, 7], [table, [1], [9]]))
        ctx = get_context()
        assert not ctx.is_prefill
        assert input_ids.tolist() == [40, 4, 5, 6, 7] and positions.tolist() == [39, 3, 0, 1, 2]
        assert ctx.slot_mapping.tolist() == [5 * 16 + 7, 16 + 3, 9 * 16, 9 * 16 + 1, 9 * 16 + 2]
        assert ctx.context_lens.tolist() == [40, 4, 1, 2, 3] and ctx.context_lens_cpu == [40, 4, 1, 2, 3]
        assert ctx.block_tables.tolist() == [[7, 2, 5], [1, -1, -1], [9, -1, -1], [9, -1, -1], [9, -1, -1]]
        assert ctx.logits_indices.tolist() == [0, 1, 4]  # each row's last token
        # mixed, with a chunk longer than SHORT_ROWS_MAX_QUERY: every row through the prefill path
        n = SHORT_ROWS_MAX_QUERY + 1
        input_ids, positions = prepare(StepInput(2, [39, 3, 0], [1, 1, n], [40, 4, *range(5, 5 + n)],
                                                 [table, [1], [9]]))
        ctx = get_context()
        assert ctx.is_prefill
        assert input_ids.tolist() == [40, 4, *range(5, 5 + n)] and positions.tolist() == [39, 3, *range(n)]
        assert ctx.slot_mapping.tolist() == [5 * 16 + 7, 16 + 3, *(9 * 16 + i for i in range(n))]
        assert ctx.cu_seqlens_q.tolist() == [0, 1, 2, 2 + n] and ctx.context_lens.tolist() == [40, 4, n]
        assert ctx.max_seqlen_q == n and ctx.query_lens_cpu == [1, 1, n]
        assert ctx.block_tables.tolist() == [[7, 2, 5], [1, -1, -1], [9, -1, -1]]
        assert ctx.logits_indices is None
    finally:
        llm.exit()
