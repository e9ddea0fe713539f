"""The greedy draft chain (nanoinfer/speculative/draft_chain.py): the draft's proposals after the first,
forwarded as one chain that reads each token on the device, equal the draft's own greedy tokens."""
from nanoinfer import LLM
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams

from test_spec_draft_model import K, proposer


def test_greedy_chain_proposes_the_drafts_own_greedy_tokens(tiny_qwen3, make_checkpoint):
    """The greedy proposals after the first run as one chain (speculative/draft_chain.py): each row's equal
    the draft's own greedy continuation, for rows of different lengths allowed different numbers of
    proposals in one batch (a row allowed fewer sits out the chain's later forwards)."""
    draft = make_checkpoint(seed=1, num_layers=1)
    p = proposer(tiny_qwen3, draft)
    plain = LLM(draft, kvcache_block_size=16, max_model_len=128, enforce_eager=True)
    try:
        bm = BlockManager(32, 16)
        prompts = [[5, 17, 33, 8, 91, 120, 7, 64, 3, 250, 11, 42, 9],
                   [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], [200, 100], [7] * 30]
        max_lens = [K, 1, 2, K - 1]
        seqs = [Sequence(ids, SamplingParams(temperature=0, max_tokens=50), 16) for ids in prompts]
        for seq, m in zip(seqs, max_lens):
            assert bm.allocate(seq) and bm.append_slot(seq, m)
        proposals = p.propose(seqs, max_lens)
        outs = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=K, ignore_eos=True), use_tqdm=False)
        for got, m, out in zip(proposals, max_lens, outs):
            assert got == out.outputs[0].token_ids[:m]
    finally:
        p.exit()
        plain.exit()
