"""Draft-model proposals: a smaller model with the target's vocabulary, run by the same engine (in
this process, on the target's device) with its own KV cache of as many blocks, addressed through
the target's block tables, so it needs no block bookkeeping of its own.

Per engine step, for the speculative rows: one forward catches each sequence's draft KV up to its
last token and proposes the first token, then k - 1 one-token forwards propose the rest. Greedy
requests propose the draft's argmax, the k - 1 forwards launched as one chain that reads each
token on the device (speculative/draft_chain.py: one CUDA graph, no host round trip between them); with
sampled requests, or greedy ones whose options change the logits (penalties, logit bias, allowed
tokens, bad words, min_tokens: `proposes_argmax`), each proposal is drawn with the request's own
sampling options and noise (`_sample_input`), the proposals so far read on the host. Its KV
stays valid for the tokens the target accepted; past them it is overwritten next time (a sequence
re-allocated after a preemption starts over).
"""
import random
import weakref
from dataclasses import dataclass

import torch

from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.step.step_message import SampleInput, SamplingPlan, StepInput
from nanoinfer.sampling.plan import build_sampling_plan
from nanoinfer.sampling_options import default_options
from nanoinfer.sampling_options.token_constraints import rank_store
from nanoinfer.sampling_params import SAMPLING_EPS
from nanoinfer.speculative.device_inputs import DeviceTokens
from nanoinfer.speculative.draft_chain import GreedyDraftChain
from nanoinfer.speculative.proposer import DeviceProposals, Proposer
from nanoinfer.speculative.draft_rows import DraftView
from nanoinfer.utils.hf_files import load_tokenizer
from nanoinfer.utils.staging import Staging


@dataclass(slots=True)
class DraftState:
    """What the draft computed for a sequence last time: its length then, its proposals (K/V of
    all but the last were written), and the preemption count then."""
    num_tokens: int
    proposals: list[int]
    num_preemptions: int


def proposes_argmax(sp) -> bool:
    """Whether the request's next token is the draft's plain argmax: greedy, and nothing changes
    the logits before it (a greedy request with penalties, logit bias, allowed tokens, bad words or
    min_tokens proposes through its sampling plan, as the target will verify it; else its proposals
    are mostly rejected)."""
    return sp.temperature < SAMPLING_EPS and not sp.has_token_constraints and not sp.min_tokens and \
        sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and sp.repetition_penalty == 1.0


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
    def __init__(self, config: Config, spec, tokenizer, target_runner, num_blocks: int, eos_token_ids=frozenset()):
        dconf = draft_config(config, spec, num_blocks)
        check_same_vocabulary(config, dconf, tokenizer)
        self.vocab_size, self.eos_token_ids = config.hf_config.vocab_size, eos_token_ids  # (for sampling plans)
        self.seeds = random.Random(config.seed + 1)  # fused plans' noise seeds: not the target's
        self.runner = ModelRunner(dconf)
        # (sampled proposals': their token constraints read the draft runner's store, in this process)
        self.sampling_options = default_options(store=rank_store(self.runner.sampler.option_states, self.runner.device))
        self.chain = GreedyDraftChain(self.runner, spec.num_speculative_tokens - 1)
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
        if self.runner.graph_runner.graphs:  # (CUDA, not enforce_eager)
            self.chain.capture()

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
        if all(map(self.launches, seqs)):  # (the same proposals, brought to the host)
            return self.launch(seqs, max_lens, [seq.num_tokens for seq in seqs]).finish()
        n = [seq.num_tokens for seq in seqs]
        proposals = [[] for _ in seqs]
        rows = list(range(len(seqs)))
        launched = [(rows, self._launch_first(seqs, n, True))]
        for j in range(1, max(max_lens)):  # the proposal after d_j, from d_j at position n + j - 1
            launched = self._collect(launched, proposals)  # (the sampling plan reads the proposals so far)
            rows = [i for i in rows if max_lens[i] > j]
            step = StepInput(len(rows), [n[i] + j - 1 for i in rows], [1] * len(rows),
                             [proposals[i][-1] for i in rows], [seqs[i].block_table for i in rows])
            launched.append((rows, self.runner.launch(step, self._sample_input(seqs, rows, proposals, True), None)))
        self._collect(launched, proposals)
        self._record(seqs, n, proposals, [seq.num_preemptions for seq in seqs])
        return proposals

    def launches(self, seq) -> bool:
        return proposes_argmax(seq.sampling_params)

    @torch.inference_mode()
    def launch(self, seqs: list, max_lens: list[int], lengths: list[int], chained=None) -> DeviceProposals:
        """Greedy requests whose proposals are the draft's argmax: the first from a catch-up
        forward, the rest from one chain (speculative/draft_chain.py), all left on the device. A chained
        row's catch-up is its last two tokens, on the device (speculative/chaining.py): the K/V before
        them are the draft's already (its last launch computed them, with the proposals the target
        accepted); its positions are shifted there. Rows are launched host rows first."""
        chained_rows = set(chained.rows) if chained is not None else ()
        on_host = [i for i in range(len(seqs)) if i not in chained_rows]
        order = on_host + (chained.rows if chained is not None else [])
        seqs, max_lens, n = [seqs[i] for i in order], [max_lens[i] for i in order], [lengths[i] for i in order]
        preemptions = [seq.num_preemptions for seq in seqs]
        firsts, queries, offsets = [], [], None  # per group: its catch-up, its first query tokens
        if on_host:
            h = len(on_host)
            firsts.append(self._launch_first(seqs[:h], n[:h], False))
            staged = Staging()
            part = staged.add([seq.token_ids[-1] for seq in seqs[:h]])
            queries.append(staged.send(self.runner.device)[part])
        if chained is not None:
            c, h = len(chained.rows), len(on_host)
            step = StepInput(0, [m - 2 for m in n[h:]], [2] * c, [0] * 2 * c, [seq.block_table for seq in seqs[h:]])
            last_two = DeviceTokens(torch.stack([chained.last, chained.bonus], 1), list(range(2 * c)),
                                    list(range(2 * c)), chained.shift)
            firsts.append(self.runner.launch(step, self._sample_input(seqs, list(range(c)), None, False), None,
                                             last_two))
            queries.append(chained.bonus)
            offsets = chained.shift if not on_host else \
                torch.cat([torch.zeros(h, dtype=torch.int64, device=self.runner.device), chained.shift])
        first = firsts[0].tokens if len(firsts) == 1 else torch.cat([f.tokens for f in firsts])
        tokens = [(queries[0] if len(queries) == 1 else torch.cat(queries))[:, None], first[:, None]]
        rest, event = None, None
        if max(max_lens) > 1:
            rest, event = self.chain.launch(first, n, max_lens, [seq.block_table for seq in seqs], offsets)
            tokens.append(self.chain.out[:, :len(seqs)].T)

        def finish() -> list[list[int]]:
            # (the device's, clamped: a row with no finite logit proposed 0)
            proposals = [[max(t, 0)] for f in firsts for t in self.runner.collect(f).tokens]
            if event is not None:
                event.synchronize()
            if rest is not None:
                for i, later in enumerate(rest.T.tolist()):
                    proposals[i] += later[:max_lens[i] - 1]
            # (a chained row's length is the host's now: the step it was chained onto is processed;
            # a preemption since the launch voids them)
            self._record(seqs, [seq.num_tokens for seq in seqs], proposals, preemptions)
            return proposals
        return DeviceProposals(torch.cat(tokens, 1), finish, [seq.seq_id for seq in seqs], max_lens, offsets)

    def _launch_first(self, seqs: list, n: list[int], sampled: bool):
        """The forward that catches each row's draft K/V up to its last token and proposes its first
        token."""
        starts = self._catch_up(seqs, n, [self._valid(seq) for seq in seqs])
        step = StepInput(0, starts, [ni - s for ni, s in zip(n, starts)],
                         [t for seq, s in zip(seqs, starts) for t in seq.token_ids[s:]],
                         [seq.block_table for seq in seqs])
        return self.runner.launch(step, self._sample_input(seqs, list(range(len(seqs))), [[] for _ in seqs], sampled),
                                  None)

    def _record(self, seqs: list, n: list[int], proposals: list[list[int]], preemptions: list[int]):
        for seq, ni, p, count in zip(seqs, n, proposals, preemptions):
            self._states[seq] = DraftState(ni, p, count)

    def _catch_up(self, seqs: list, n: list[int], starts: list[int]) -> list[int]:
        """The rows' draft K/V from `starts` on, forwarded (its samples unused) in chunks of at most
        max_num_batched_tokens until what is left, each row's last token included, fits the
        proposing forward's budget too: a long prompt, or a sequence back from preemption, would
        else be one forward over all of it. Returns the new starts."""
        budget = self.runner.config.max_num_batched_tokens
        starts = list(starts)
        left = sum(ni - s for ni, s in zip(n, starts))
        while left > budget:
            rows, lens, room = [], [], budget
            for i, (ni, s) in enumerate(zip(n, starts)):
                take = min(ni - 1 - s, room)  # (each row's last token stays for the proposing forward)
                if take > 0:
                    rows.append(i)
                    lens.append(take)
                    room -= take
                if not room:
                    break
            if not rows:
                break
            step = StepInput(0, [starts[i] for i in rows], lens,
                             [t for i, k in zip(rows, lens) for t in seqs[i].token_ids[starts[i]:starts[i] + k]],
                             [seqs[i].block_table for i in rows])
            self.runner.collect(self.runner.launch(step, self._sample_input(seqs, rows, None, False), None))
            for i, k in zip(rows, lens):
                starts[i] += k
                left -= k
        return starts

    def _sample_input(self, seqs, rows: list[int], proposals, sampled: bool) -> SampleInput:
        """Greedy rows propose their argmax. Otherwise (`sampled`), every row draws its proposal with
        the options the target will verify that position with (sampling/plan.py on the same
        DraftViews), seeded noise included: a draft equal to its target then proposes exactly the
        target's sample, and any other draft draws either that same noise or independent noise,
        which keeps verification exact (speculative/rows.py, accepted_runs)."""
        if not sampled:
            return SampleInput(SamplingPlan([0.0] * len(rows), all_greedy=True, any_greedy=True, seed=0))
        views = [DraftView(seqs[i], proposals[i]) for i in rows]
        return SampleInput(build_sampling_plan(views, self.vocab_size, self.eos_token_ids, [True] * len(rows),
                                               None, self.seeds, options=self.sampling_options))

    def _collect(self, launched: list, proposals: list[list[int]]) -> list:
        for rows, inflight in launched:
            for i, token in zip(rows, self.runner.collect(inflight).tokens):
                proposals[i].append(max(token, 0))  # (a draft row with no finite logit proposes 0, as on the device)
        return []

    def exit(self):
        self.chain.release()  # (its graphs share the runner's memory pool)
        self.runner.exit()
