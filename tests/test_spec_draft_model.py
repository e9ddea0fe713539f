"""The draft model's KV (nanoinfer/speculative/draft_model.py): after a partly accepted run it catches up
from the first rejected position, and its proposals equal those of a draft computing everything
afresh (greedy, and sampled with a seed: the same noise); after a preemption it starts over."""
import pytest

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.speculative.config import SpeculativeConfig
from nanoinfer.speculative.draft_model import DraftModelProposer
from nanoinfer.utils.hf_files import load_tokenizer

K = 4


def proposer(target, draft):
    config = Config(target, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=128)
    p = DraftModelProposer(config, SpeculativeConfig("draft_model", K, draft), load_tokenizer(target), None, 32)
    p.allocate(32)
    return p


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=50),
                                    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=50)])
def test_catch_up_after_a_partly_accepted_run_equals_a_fresh_draft(tiny_qwen3, make_checkpoint, params):
    draft = make_checkpoint(seed=1, num_layers=1)
    kept, fresh = proposer(tiny_qwen3, draft), proposer(tiny_qwen3, draft)
    try:
        bm = BlockManager(32, 16)
        seq = Sequence([5, 17, 33, 8, 91, 120, 7, 64, 3, 250, 11, 42, 9], params, 16)
        assert bm.allocate(seq) and bm.append_slot(seq, K)
        first = kept.propose([seq], [K])[0]
        assert len(first) == K
        n = seq.num_tokens
        # the target accepts two proposals, then samples something else
        for t in first[:2] + [(first[2] + 1) % 300]:
            seq.append_token(t)
        assert kept._valid(seq) == n + 2
        assert bm.append_slot(seq, K)
        again = kept.propose([seq], [K])[0]
        assert again == fresh.propose([seq], [K])[0]
        seq.num_preemptions += 1  # its blocks were dropped: the draft's K/V with them
        assert kept._valid(seq) == 0
    finally:
        kept.exit()
        fresh.exit()

