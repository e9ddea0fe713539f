"""The engine's request side, mixed into LLMEngine: requests live in one registry, `requests`
(request id -> Request), until their output is taken; aborts from any thread are queued and applied
between steps."""
import logging
import time

from nanoinfer.engine.output_processor import Request
from nanoinfer.step.sequence import Sequence
from nanoinfer.outputs import RequestOutput, StreamDelta
from nanoinfer.sampling_params import SamplingParams

logger = logging.getLogger("nanoinfer")


class EngineRequests:
    """add / abort / outputs over LLMEngine's registry, scheduler, features and processors."""

    def add_requests(self, prompts: list, sampling_params: list, *, stream: bool = False,
                     keep_output: bool = False, max_tokens_must_fit: bool = False,
                     lora_requests: list | None = None, priority=None) -> list[int]:
        """Validate every request, then queue them all (a bad one queues none; the error names its
        index). Returns the request ids. stream: detokenize every step (for stream_deltas).
        keep_output: the request stays until pop_output(); step() does not report it.
        max_tokens_must_fit: see InputProcessor.process. lora_requests: each prompt's LoRARequest or
        None. priority: an int for all or one per prompt (scheduling_policy="priority": the lower
        runs first). A feature may take other params than SamplingParams (PoolingParams)."""
        self._check_open()
        priorities = self.scheduler.order.priorities(priority, len(prompts))
        prepared = self.input_processor.process_all(prompts, sampling_params, max_tokens_must_fit, lora_requests)
        rids = []
        with self._locked():  # an abort from another thread reads the registry meanwhile
            self._check_open()  # (exit() may have run on another thread meanwhile)
            for i, (request, p) in enumerate(zip(prepared, priorities)):
                seqs = request.seqs
                for seq in seqs:
                    seq.priority = p
                req = self.output_processor.new_request(seqs, request.prompt, keep_output, stream, i)
                self.requests[req.request_id] = req
                self.scheduler.add(seqs[0])
                for seq in seqs[1:]:
                    self.scheduler.add(seq, after=seqs[0])  # waits for the first's prompt, then shares its blocks
                rids.append(req.request_id)
        return rids

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *, stream: bool = False,
                    keep_output: bool = False, lora_request=None, priority: int = 0) -> int:
        """Queue a request (a str, a list of token ids, or a {"prompt", "prompt_token_ids"} dict);
        returns its request id. With n > 1, step() reports each sample under its own sequence id
        (the first is the request id)."""
        return self.add_requests([prompt], [sampling_params], stream=stream, keep_output=keep_output,
                                 lora_requests=[lora_request], priority=[priority])[0]

    def abort_request(self, request_id: int):
        """Stop a request (all n samples; or one sample, given its sequence id) wherever it is; its
        blocks are freed, the other requests go on. Safe from any thread: while a step is running
        the abort waits for the step's end."""
        self._aborts.append(request_id)
        with self._locked(timeout=0) as acquired:
            if acquired:
                self._apply_aborts()

    def _apply_aborts(self):
        now = time.time()
        for _ in range(len(self._aborts)):  # those queued so far: another thread cannot stall the step
            rid = self._aborts.popleft()
            req = self.requests.get(rid)
            seqs = req.seqs if req is not None else \
                [s for r in self.requests.values() for s in r.seqs if s.seq_id == rid]
            seqs = [seq for seq in seqs if not seq.is_finished]
            for seq in seqs:
                self.scheduler.abort(seq)
            self._finished(seqs, now)
        self._drop_wasted_step()

    def get_output(self, request_id: int) -> RequestOutput:
        """The request's output so far (text, tokens, logprobs, finish reasons)."""
        return self._output(self._request(request_id))

    def _output(self, req: Request):
        for feature in self.features:  # (a feature may build it: an embedding)
            out = feature.request_output(req)
            if out is not None:
                return out
        out = self.output_processor.request_output(req)
        for feature in self.features:  # (a feature may add its part: prompt logprobs)
            feature.add_output(req, out)
        return out

    def feature(self, kind: type):
        """The registered feature of class `kind`, or None."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    def pop_output(self, request_id: int) -> RequestOutput:
        """The request's output; the engine then forgets the request (aborting what still runs)."""
        with self._locked():  # an abort from another thread reads the registry meanwhile
            req = self._request(request_id)
            if not req.finished:
                self._aborts.append(request_id)
                self._apply_aborts()
            self.requests.pop(request_id, None)  # (an aborted hand request has already left)
            self.output_processor.forget(req)
            return self._output(req)

    def stream_deltas(self, request_id: int, index: int = 0) -> list[StreamDelta]:
        """For a request added with stream=True: what each of its completions produced since the
        last call; a completion's last delta has finished=True. `index` fills StreamDelta.index."""
        return self.output_processor.stream_deltas(self._request(request_id), index)

    def take_stream_deltas(self, request_ids) -> list[StreamDelta]:
        """stream_deltas of every request in `request_ids` (a set or dict) with news, visiting only
        those; StreamDelta.index is the prompt's position in its add_requests call."""
        with self._locked():  # an abort from another thread records news meanwhile
            return self.output_processor.take_deltas(request_ids)

    def _request(self, request_id: int) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id} (unknown, or its output was already taken)")
        return req

    def _finished(self, seqs: list[Sequence], now: float):
        """Record finished sequences; report their requests once every sample is done."""
        done = {}
        for seq in seqs:
            req = self.requests[seq.request_id]
            if seq.finish_reason == "error":  # (no token could be sampled, or its intake work failed)
                logger.warning("request %d (sample %d) failed: %s", req.request_id, seq.index, seq.stop_reason)
            self.output_processor.mark_finished(req, seq, now)
            if not req.keep_output and seq.finish_reason != "abort":
                self._unreported.append((seq.seq_id, seq.completion_token_ids))
            if req.finished:
                done[req.request_id] = req
        for rid, req in done.items():
            self._finished_ids.append(rid)
            if not req.keep_output:
                del self.requests[rid]
                self.output_processor.forget(req)
