"""The engine loop: validate and queue requests, schedule a batch, run it, record the results."""
import atexit
import json
import os
from dataclasses import replace
from numbers import Integral

from transformers import AutoTokenizer

from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.output_processor import OutputProcessor
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.engine.tp_worker import TensorParallelRunner
from nanoinfer.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model: str, **options):
        self.config = config = Config.from_options(model, **options)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        except (OSError, ValueError) as e:
            raise ValueError(f"could not load a tokenizer from {config.model!r}: {e}") from e
        config.eos_token_ids = tuple(sorted(self._eos_token_ids(config.model)))
        self.vocab_size = config.hf_config.vocab_size
        self._exited = False
        self.pending = None  # a launched, uncollected decode step (overlapped decode)
        # tp > 1: rank 0 here plus spawned workers; its num_blocks is the minimum over ranks
        self.model_runner = ModelRunner(config) if config.tensor_parallel_size == 1 else TensorParallelRunner(config)
        num_blocks = self.model_runner.num_blocks
        if num_blocks * config.kvcache_block_size < config.max_model_len:
            self.model_runner.exit()
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {config.kvcache_block_size} tokens = "
                f"{num_blocks * config.kvcache_block_size} tokens, less than one max_model_len={config.max_model_len} "
                "sequence; raise num_kvcache_blocks / gpu_memory_utilization or lower max_model_len")
        self.model_runner.allocate_kv_cache(num_blocks)
        self.scheduler = Scheduler(config, num_blocks)
        self.requests: dict[int, Sequence] = {}
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, config.eos_token_ids)
        atexit.register(self.exit)

    def _eos_token_ids(self, path: str) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return ids

    # ---- requests -------------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams | None) -> Sequence:
        """Validate one request and build its Sequence, without queueing it."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
                raise TypeError("a token-id prompt must be a list of ints")
            token_ids = [int(t) for t in prompt]  # numpy / torch integers too
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        sp = sampling_params
        bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if sp.logprobs is not None and sp.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {self.vocab_size}, got {sp.logprobs}")
        # max_tokens=None: up to max_model_len
        total = len(token_ids) + (sp.max_tokens if sp.max_tokens is not None else 1)
        if total > self.config.max_model_len:
            raise ValueError(f"prompt length {len(token_ids)} + max_tokens {sampling_params.max_tokens} = {total} "
                             f"exceeds max_model_len={self.config.max_model_len}")
        if sp.max_tokens is None:
            total = self.config.max_model_len
        capacity = self.scheduler.block_manager.num_blocks * self.config.kvcache_block_size
        if total > capacity:
            raise ValueError(f"prompt length + max_tokens = {total} tokens cannot fit the whole KV cache "
                             f"({capacity} tokens)")
        return Sequence(token_ids, sampling_params, self.config.kvcache_block_size)

    def make_request(self, prompt: str | list[int], sampling_params: SamplingParams | None) -> list[Sequence]:
        """Validate one request and build its n sequences (one per sample), without queueing them.
        With a seed, sample i uses seed + i (as vLLM does), so the samples differ."""
        first = self.make_sequence(prompt, sampling_params)
        sp = first.sampling_params
        seqs = [first]
        for i in range(1, sp.n):
            child = sp if sp.seed is None else replace(sp, seed=sp.seed + i)
            seqs.append(Sequence(first.token_ids, child, self.config.kvcache_block_size))
        return seqs

    def add_sequences(self, seqs: list[Sequence], prompt: str | None = None, collect: bool = False,
                      incremental: bool = False) -> int:
        """Queue the sequences of one request (from make_request); returns the request id (the
        first sequence's id). The others wait until the first one's prompt is in the KV cache, then
        reuse its blocks. collect: keep the output state for LLM to read; incremental: detokenize
        every step (streaming)."""
        for seq in seqs:
            self.requests[seq.seq_id] = seq
        self.scheduler.add(seqs[0])
        for seq in seqs[1:]:
            self.scheduler.add(seq, after=seqs[0])
        self.output_processor.add(seqs, prompt, collect, incremental)
        return seqs[0].seq_id

    def add_sequence(self, seq: Sequence) -> int:
        return self.add_sequences([seq])

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its request id. Raises ValueError/TypeError on bad input.
        With n > 1, step() reports each sample under its own sequence id (the first is the
        request id)."""
        return self.add_sequences(self.make_request(prompt, sampling_params),
                                  prompt if isinstance(prompt, str) else None)

    def abort_request(self, request_id: int):
        """Stop a request (all n samples; or one sample, given its sequence id) wherever it is;
        its blocks are freed, the other requests go on."""
        seqs = self.output_processor.sequences(request_id) or \
            [s for s in [self.requests.get(request_id)] if s is not None]
        for seq in seqs:
            if self.requests.pop(seq.seq_id, None) is not None:
                self.scheduler.abort(seq)
        self.output_processor.aborted(seqs)
        self._drop_wasted_pending()

    # ---- loop -----------------------------------------------------------------------------------
    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Run one batch. Returns the (request_id, completion_token_ids) pairs that finished, and
        the tokens processed: positive for a prefill step, minus the batch size for a decode step
        (nano-vllm's convention, which its throughput display relies on).

        Overlapped decode (async_scheduling, one rank): a decode step is launched and collected in
        the next call, after that call has launched the following decode step, so the host's
        bookkeeping of step N runs while the device computes step N+1. The tokens counted are
        those launched in the call."""
        if self.pending is not None:
            pending = self.pending
            nxt = None
            if self._overlappable(pending.seqs):
                batch = self.scheduler.schedule_ahead(pending.seqs)
                if batch:
                    nxt = self.model_runner.launch_decode(batch, pending)
            self.pending = nxt
            token_ids = self.model_runner.collect(pending)
            outputs = self._postprocess(pending.seqs, token_ids, False)
            self._drop_wasted_pending()
            return outputs, -len(nxt.seqs) if nxt else 0
        if self.scheduler.is_finished():
            return [], 0
        seqs, is_prefill = self.scheduler.schedule()
        if not is_prefill and self._overlappable(seqs):
            self.pending = self.model_runner.launch_decode(seqs, None)
            return [], -len(seqs)
        num_tokens = sum(s.num_scheduled_tokens for s in seqs) if is_prefill else -len(seqs)
        token_ids = self.model_runner.run(seqs, is_prefill)
        return self._postprocess(seqs, token_ids, is_prefill), num_tokens

    def _drop_wasted_pending(self):
        """A launched step whose every row has stopped meanwhile is wasted: wait for it and drop
        it, so that is_finished() is true as soon as no request is left."""
        if self.pending is not None and all(s.is_finished for s in self.pending.seqs):
            self.model_runner.collect(self.pending)
            self.pending = None

    def _overlappable(self, seqs: list[Sequence]) -> bool:
        """Overlap needs one rank, and requests whose sampling does not read their own latest token
        (penalties, seeds, min_tokens) and that want no logprobs."""
        if not self.config.async_scheduling or self.config.tensor_parallel_size > 1:
            return False
        for seq in seqs:
            sp = seq.sampling_params
            if sp.seed is not None or sp.min_tokens or sp.logprobs is not None or sp.presence_penalty \
                    or sp.frequency_penalty or sp.repetition_penalty != 1.0:
                return False
        return True

    def _postprocess(self, seqs, token_ids, is_prefill) -> list[tuple[int, list[int]]]:
        finished = self.scheduler.postprocess(seqs, token_ids, is_prefill)
        finished = self.output_processor.process(seqs, token_ids, finished)  # logprobs, stop strings
        for seq in finished:
            self.requests.pop(seq.seq_id, None)
        return [(s.seq_id, s.completion_token_ids) for s in finished]

    def is_finished(self) -> bool:
        return self.pending is None and self.scheduler.is_finished()

    def exit(self):
        if self._exited:
            return
        self._exited = True
        if hasattr(self, "model_runner"):
            self.model_runner.exit()
        atexit.unregister(self.exit)
