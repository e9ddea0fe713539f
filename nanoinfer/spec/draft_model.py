"""Draft-model proposals: a smaller model with the target's vocabulary, run by the same engine (in
this process, on the target's device) with its own KV cache of as many blocks, addressed through
the target's block tables, so it needs no block bookkeeping of its own.

Per engine step, for the speculative rows: one forward catches each sequence's draft KV up to its
last token and proposes the first token, then k - 1 one-token forwards propose the rest, each
reading the previous forward's tokens on the device (no host round trip between them). The draft
proposes its argmax (a deterministic proposal: see spec/proposer.py). Its KV stays valid for the
tokens the target accepted; past them it is overwritten next time (a sequence re-allocated after a
preemption starts over).
"""
import weakref
from dataclasses import dataclass

import torch

from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.step_message import SampleInput, SamplingPlan, StepInput
from nanoinfer.spec.proposer import Proposer
from nanoinfer.utils.hf_files import load_tokenizer


@dataclass(slots=True)
class DraftState:
    """What the draft computed for a sequence last time: its length then, its proposals (K/V of
    all but the last were written), and the preemption count then."""
    num_tokens: int
    proposals: list[int]
    num_preemptions: int


def draft_config(config: Config, spec, num_blocks: int) -> Config:
    """The draft's engine options: the target's shape of cache and batch, on its device."""
    try:
        return _draft_config(config, spec, num_blocks)
    except (ValueError, TypeError) as e:
        raise type(e)(f"speculative_config['model'] {spec.model!r}: {e}") from e


def _draft_config(config: Config, spec, num_blocks: int) -> Config:
    return Config.from_options(
        spec.model, device=config.device, dtype=config.dtype, kvcache_block_size=config.kvcache_block_size,
        num_kvcache_blocks=num_blocks, max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, enforce_eager=config.enforce_eager,
        kv_cache_dtype=config.kv_cache_dtype, seed=config.seed, load_format=config.load_format)


def check_same_vocabulary(config: Config, draft: Config, tokenizer):
    if draft.hf_config.vocab_size != config.hf_config.vocab_size:
        raise ValueError(f"speculative_config['model']: the draft's vocab_size {draft.hf_config.vocab_size} differs "
                         f"from the target's {config.hf_config.vocab_size}; a draft needs the same vocabulary")
    if load_tokenizer(draft.tokenizer).get_vocab() != tokenizer.get_vocab():
        raise ValueError("speculative_config['model']: the draft's tokenizer differs from the target's; "
                         "a draft needs the same tokenizer")


class DraftModelProposer(Proposer):
    def __init__(self, config: Config, spec, tokenizer, target_runner, num_blocks: int):
        dconf = draft_config(config, spec, num_blocks)
        check_same_vocabulary(config, dconf, tokenizer)
        self.runner = ModelRunner(dconf)
        self.block_size = config.kvcache_block_size
        self.num_blocks = self._share(config, target_runner, num_blocks)
        self._states = weakref.WeakKeyDictionary()  # sequence -> DraftState

    def _share(self, config: Config, target_runner, num_blocks: int) -> int:
        """On CUDA with a measured pool: the blocks that fit the memory the target measured, less
        the draft's weights, when every block holds both models' K/V."""
        if config.device != "cuda" or config.num_kvcache_blocks is not None:
            return num_blocks
        target, draft = target_runner.kv_cache.block_bytes, self.runner.kv_cache.block_bytes
        weights = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
        return max((num_blocks * target - weights) // (target + draft), 0)

    def allocate(self, num_blocks: int):
        self.runner.allocate_kv_cache(num_blocks)

    def _valid(self, seq) -> int:
        """Positions whose draft K/V are valid: those the last proposals computed, up to the first
        proposal the target did not accept."""
        state = self._states.get(seq)
        if state is None or state.num_preemptions != seq.num_preemptions:
            return 0
        n, written = state.num_tokens, state.proposals[:-1]
        accepted = 0
        tokens = seq.token_ids
        while accepted < len(written) and n + accepted < len(tokens) and tokens[n + accepted] == written[accepted]:
            accepted += 1
        return min(n + accepted, seq.num_tokens - 1)

    @torch.inference_mode()
    def propose(self, seqs: list, max_lens: list[int]) -> list[list[int]]:
        n = [seq.num_tokens for seq in seqs]
        starts = [self._valid(seq) for seq in seqs]
        first = StepInput(0, starts, [ni - s for ni, s in zip(n, starts)],
                          [t for seq, s in zip(seqs, starts) for t in seq.token_ids[s:]],
                          [seq.block_table for seq in seqs])
        launched = [(list(range(len(seqs))), self.runner.launch(first, greedy(len(seqs)), None))]
        for j in range(1, max(max_lens)):  # the proposal after d_j, from d_j at position n + j - 1
            prev_row = {i: r for r, i in enumerate(launched[-1][0])}
            rows = [i for i in prev_row if max_lens[i] > j]
            step = StepInput(len(rows), [n[i] + j - 1 for i in rows], [1] * len(rows), [0] * len(rows),
                             [seqs[i].block_table for i in rows], list(range(len(rows))),
                             [prev_row[i] for i in rows])
            launched.append((rows, self.runner.launch(step, greedy(len(rows)), launched[-1][1])))
        proposals = [[] for _ in seqs]
        for rows, inflight in launched:
            for i, token in zip(rows, self.runner.collect(inflight).tokens):
                proposals[i].append(token)
        for seq, ni, p in zip(seqs, n, proposals):
            self._states[seq] = DraftState(ni, p, seq.num_preemptions)
        return proposals

    def exit(self):
        self.runner.exit()


def greedy(rows: int) -> SampleInput:
    return SampleInput(SamplingPlan([0.0] * rows, all_greedy=True, any_greedy=True, seed=0))
