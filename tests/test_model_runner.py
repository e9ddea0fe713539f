import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.model_runner import graph_batch_sizes
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
    """Inputs the runner builds for a prefill chunk over a cached prefix and for a decode."""
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64)
    try:
        runner = llm.model_runner
        seq = llm.make_sequence(list(range(1, 41)), SamplingParams(max_tokens=4))
        seq.block_table = [7, 2, 5]
        seq.num_computed_tokens, seq.num_scheduled_tokens = 16, 20  # positions 16..35
        input_ids, positions = runner.prepare_prefill([seq])
        ctx = get_context()
        assert input_ids.tolist() == list(range(17, 37)) and positions.tolist() == list(range(16, 36))
        assert ctx.slot_mapping.tolist() == [2 * 16 + i for i in range(16)] + [5 * 16 + i for i in range(4)]
        assert ctx.cu_seqlens_q.tolist() == [0, 20] and ctx.context_lens.tolist() == [36]
        assert ctx.block_tables.tolist() == [[7, 2, 5]]
        input_ids, positions = runner.prepare_decode([seq])  # 40 tokens: the last is at position 39
        ctx = get_context()
        assert input_ids.tolist() == [40] and positions.tolist() == [39]
        assert ctx.slot_mapping.tolist() == [5 * 16 + 7] and ctx.context_lens.tolist() == [40]
        runner.prepare_decode([seq], ahead=1)  # one in-flight token: position 40
        assert get_context().slot_mapping.tolist() == [5 * 16 + 8]
    finally:
        llm.exit()
