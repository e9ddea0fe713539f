"""After each step: record logprobs and timings, detokenize incrementally where needed, stop
sequences at stop strings (freeing their blocks at once), and build the user-facing outputs.

A request is one prompt with its n sequences (`n > 1`); its id is its first sequence's id.
Detokenization runs every step only for requests that need text while running (stop strings or
streaming); the others are decoded once when they finish.
"""
import time

from nanoinfer.engine.detokenizer import IncrementalDetokenizer, decode
from nanoinfer.engine.sequence import Sequence
from nanoinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StreamDelta


class CompletionState:
    __slots__ = ("seq", "index", "request", "detok", "logprobs", "cumulative_logprob", "first_token_time",
                 "finished_time", "stop_reason", "num_seen", "num_cached_tokens", "streamed_chars",
                 "streamed_tokens", "stream_done")

    def __init__(self, seq: Sequence, index: int, request: "RequestState", detok):
        self.seq, self.index, self.request, self.detok = seq, index, request, detok
        wants_lp = seq.sampling_params.logprobs is not None
        self.logprobs = [] if wants_lp else None
        self.cumulative_logprob = 0.0 if wants_lp else None
        self.first_token_time = self.finished_time = self.stop_reason = None
        self.num_seen = 0           # completion tokens already processed
        self.num_cached_tokens = 0
        self.streamed_chars = self.streamed_tokens = 0
        self.stream_done = False


class RequestState:
    def __init__(self, seqs: list[Sequence], prompt: str | None, collect: bool):
        self.request_id = seqs[0].seq_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        self.sampling_params = seqs[0].sampling_params
        self.arrival_time = time.time()
        self.collect = collect      # kept after finishing until the caller takes the output
        self.completions: list[CompletionState] = []

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer, scheduler, eos_token_ids):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[int, RequestState] = {}
        self.by_seq: dict[int, CompletionState] = {}
        self.aborted_ids: set[int] = set()  # requests with an aborted sequence, until dropped

    def add(self, seqs: list[Sequence], prompt: str | None = None, collect: bool = False,
            incremental: bool = False) -> RequestState:
        req = RequestState(seqs, prompt, collect)
        for i, seq in enumerate(seqs):
            sp = seq.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, sp) if incremental or sp.stop else None
            c = CompletionState(seq, i, req, detok)
            req.completions.append(c)
            self.by_seq[seq.seq_id] = c
        self.requests[req.request_id] = req
        return req

    def sequences(self, request_id: int) -> list[Sequence]:
        """The sequences a request id names: all n of a request, or the one sequence."""
        req = self.requests.get(request_id)
        if req is not None:
            return [c.seq for c in req.completions]
        c = self.by_seq.get(request_id)
        return [c.seq] if c is not None else []

    def process(self, seqs: list[Sequence], token_ids, finished: list[Sequence]) -> list[Sequence]:
        """Called with each step's batch, sampled tokens and the sequences the scheduler finished;
        returns those plus the ones a stop string finished."""
        logprobs = getattr(token_ids, "logprobs", None)
        now = None
        for i, seq in enumerate(seqs):
            c = self.by_seq.get(seq.seq_id)
            n = seq.num_completion_tokens
            if c is None or n == c.num_seen:
                continue  # not ours, or a prefill chunk that sampled nothing
            c.num_seen = n
            if now is None:
                now = time.time()
            if c.first_token_time is None:
                c.first_token_time = now
                c.num_cached_tokens = seq.num_cached_tokens
            if c.logprobs is not None and logprobs is not None and logprobs[i] is not None:
                c.logprobs.append(logprobs[i])
                c.cumulative_logprob += logprobs[i][2]
            sp = seq.sampling_params
            token = seq.token_ids[-1]
            if seq.is_finished and seq.finish_reason == "stop" and (sp.ignore_eos or token not in self.eos_token_ids):
                c.stop_reason = token  # a stop token id (EOS leaves stop_reason None)
            if c.detok is not None:
                by_token = seq.is_finished and seq.finish_reason == "stop"
                keep = not by_token or sp.include_stop_str_in_output
                stop = c.detok.add(token if keep else None, check_stop=n >= sp.min_tokens, final=seq.is_finished)
                if stop is not None:
                    c.stop_reason = stop
                    if not seq.is_finished:
                        self.scheduler.abort(seq)  # frees its blocks now
                        finished.append(seq)
                    seq.finish_reason = "stop"
            if seq.is_finished:
                c.finished_time = now
        for seq in finished:
            c = self.by_seq.get(seq.seq_id)
            if c is not None and c.finished_time is None:
                c.finished_time = now or time.time()
            if c is not None and not c.request.collect and c.request.finished:
                self.drop(c.request.request_id)
        return finished

    def aborted(self, seqs: list[Sequence]):
        now = time.time()
        for seq in seqs:
            c = self.by_seq.get(seq.seq_id)
            if c is not None:
                self.aborted_ids.add(c.request.request_id)
                if c.finished_time is None:
                    c.finished_time = now
                if not c.request.collect and c.request.finished:
                    self.drop(c.request.request_id)

    def drop(self, request_id: int):
        req = self.requests.pop(request_id, None)
        self.aborted_ids.discard(request_id)
        if req is not None:
            for c in req.completions:
                self.by_seq.pop(c.seq.seq_id, None)

    # ---- outputs --------------------------------------------------------------------------------
    def _text(self, c: CompletionState) -> str:
        if c.detok is not None:
            return c.detok.text
        seq, sp = c.seq, c.seq.sampling_params
        ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and not sp.include_stop_str_in_output and ids:
            ids = ids[:-1]  # the EOS / stop token is not part of the text
        return decode(self.tokenizer, ids, sp.skip_special_tokens)

    def _logprob_dicts(self, records) -> list[dict[int, Logprob]]:
        out = []
        for token, (top_ids, top_lps, lp, rank) in records:
            d = {token: Logprob(lp, rank, decode(self.tokenizer, [token], False))}
            for r, (tid, tlp) in enumerate(zip(top_ids, top_lps), start=1):
                if tid not in d:
                    d[tid] = Logprob(tlp, r, decode(self.tokenizer, [tid], False))
            out.append(d)
        return out

    def completion_output(self, c: CompletionState) -> CompletionOutput:
        seq = c.seq
        ids = seq.completion_token_ids
        lps = None if c.logprobs is None else self._logprob_dicts(zip(ids, c.logprobs))
        return CompletionOutput(c.index, self._text(c), ids, c.cumulative_logprob, lps,
                                seq.finish_reason if seq.is_finished else None, c.stop_reason)

    def request_output(self, request_id: int) -> RequestOutput:
        req = self.requests[request_id]
        firsts = [c.first_token_time for c in req.completions if c.first_token_time is not None]
        ends = [c.finished_time for c in req.completions if c.finished_time is not None]
        finished = req.finished
        metrics = RequestMetrics(req.arrival_time, min(firsts, default=None), max(ends) if finished and ends else None)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids),
                             [self.completion_output(c) for c in req.completions], finished, metrics,
                             req.completions[0].num_cached_tokens)

    def stream_deltas(self, request_id: int, index: int) -> list[StreamDelta]:
        """What each completion of the request produced since the last call (text is released up to
        a character boundary, minus a possible stop-string prefix)."""
        req = self.requests[request_id]
        deltas = []
        for c in req.completions:
            seq = c.seq
            done = seq.is_finished
            ids = seq.completion_token_ids
            new_ids = ids[c.streamed_tokens:]
            upto = c.detok.releasable(done)
            new_text = c.detok.text[c.streamed_chars:upto]
            if c.stream_done or (not new_ids and not new_text and not done):
                continue
            lps = None
            if c.logprobs is not None:
                lps = self._logprob_dicts(zip(new_ids, c.logprobs[c.streamed_tokens:]))
            c.streamed_tokens = len(ids)
            c.streamed_chars = max(c.streamed_chars, upto)
            c.stream_done = done
            deltas.append(StreamDelta(index, c.index, req.request_id, new_text, new_ids, lps, done,
                                      seq.finish_reason if done else None, c.stop_reason))
        return deltas
