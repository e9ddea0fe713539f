"""A request's output state and the user-facing outputs built from it. A request is one prompt with
its n sequences; its id is its first sequence's id. Where text is needed while running (stop
strings or streaming) it is detokenized incrementally as tokens are recorded; other requests are
decoded once when their output is built. The scheduler alone decides that a sequence finishes:
`record_tokens` only returns the stop strings the new text completed.
"""
import time

from nanoinfer.engine.detokenizer import IncrementalDetokenizer, completion_text, decoder
from nanoinfer.engine.scheduled_batch import StepUpdate
from nanoinfer.step.sequence import Sequence
from nanoinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StreamDelta


def logprob_dicts(tokenizer, records, detokenize: bool = True) -> list[dict[int, Logprob]]:
    """vLLM's logprobs of each position: records are (token, its TokenLogprobs) per position."""
    decode = decoder(tokenizer, False) if detokenize else (lambda ids: None)
    out = []
    for token, lp in records:
        d = {token: Logprob(lp.logprob, lp.rank, decode([token]))}
        for r, (tid, tlp) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in d:
                d[tid] = Logprob(tlp, r, decode([tid]))
        out.append(d)
    return out


class Completion:
    """Output state of one of a request's sequences."""
    __slots__ = ("seq", "detok", "logprobs", "cumulative_logprob", "first_token_time", "finished_time",
                 "num_cached_tokens", "streamed_chars", "streamed_tokens", "stream_done")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer | None):
        self.seq, self.detok = seq, detok
        wants_lp = seq.sampling_params.logprobs is not None
        self.logprobs = [] if wants_lp else None
        self.cumulative_logprob = 0.0 if wants_lp else None
        self.first_token_time = self.finished_time = None
        self.num_cached_tokens = 0
        self.streamed_chars = self.streamed_tokens = 0
        self.stream_done = False


class Request:
    def __init__(self, seqs: list[Sequence], prompt: str | None, keep_output: bool, detoks: list,
                 stream: bool = False, index: int = 0):
        self.request_id = seqs[0].request_id
        self.stream = stream  # take_deltas reports it
        self.index = index    # its prompt's position in its add_requests call (StreamDelta.index)
        self.seqs = seqs
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        self.arrival_time = time.time()
        self.keep_output = keep_output  # kept after finishing until pop_output; step() does not report it
        self.completions = [Completion(seq, d) for seq, d in zip(seqs, detoks)]
        self.num_unfinished = len(seqs)  # counted down by mark_finished: `finished` is O(1)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.news: dict[int, Request] = {}  # streamed requests with news not taken yet: take_deltas visits these

    def new_request(self, seqs: list[Sequence], prompt: str | None, keep_output: bool, stream: bool,
                    index: int = 0) -> Request:
        prompt_ids = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_ids, s.sampling_params)
                  if (stream or s.sampling_params.stop) and s.sampling_params.detokenize else None for s in seqs]
        return Request(seqs, prompt, keep_output, detoks, stream, index)

    def forget(self, req: Request):
        """The request left the engine's registry."""
        self.news.pop(req.request_id, None)

    def record_tokens(self, seqs: list[Sequence], update: StepUpdate, logprobs: list | None, requests: dict,
                      now: float) -> dict[int, str]:
        """Record the tokens the scheduler appended to the rows `update.appended` (rows of `seqs` and of
        the step's `logprobs`). Returns row -> the stop string its new text completed, for the engine
        to finish; none for a row that ends on a token (EOS and stop ids win). A row of several tokens
        (`update.counts`; its `logprobs` entry a list) is recorded token by token: a stop string
        completed before its last drops the tokens after it."""
        news, stops, ending, counts = self.news, {}, update.ending, update.counts
        for row in update.appended:
            seq = seqs[row]
            req = requests[seq.request_id]
            if req.stream:
                news[req.request_id] = req
            c = req.completions[seq.index]
            if c.first_token_time is None:
                c.first_token_time = now
                c.num_cached_tokens = seq.num_cached_tokens
            run = counts.get(row) if counts else None
            num = kept = 1 if run is None else run
            if c.detok is not None:
                first = seq.num_tokens - num
                for i in range(num):
                    stop = self._add_text(c, seq, first + i, ending.get(row) if i == num - 1 else None)
                    if stop is not None:
                        stops[row], kept = stop, i + 1
                        break
                if kept < num:  # (the engine finishes the sequence on the stop string)
                    del seq.token_ids[first + kept:]
                    counts[row] = kept
            if c.logprobs is not None and logprobs is not None:
                for lp in (logprobs[row][:kept] if run is not None else (logprobs[row],)):
                    c.logprobs.append(lp)
                    c.cumulative_logprob += lp.logprob
        return stops

    @staticmethod
    def _add_text(c: Completion, seq: Sequence, i: int, end) -> str | None:
        """Detokenize the sequence's token i (`end`: (finish_reason, stop_reason) if it ends the
        sequence); returns the stop string its text completed, unless the token itself stopped it."""
        sp = seq.sampling_params
        stopped_by_token = end is not None and end[0] == "stop"
        keep = not stopped_by_token or sp.include_stop_str_in_output
        stop = c.detok.add(seq.token_ids[i] if keep else None,
                           check_stop=i + 1 - seq.num_prompt_tokens >= sp.min_tokens, final=end is not None)
        return None if stopped_by_token else stop

    def mark_finished(self, req: Request, seq: Sequence, now: float):
        if req.stream:
            self.news[req.request_id] = req
        c = req.completions[seq.index]
        if c.finished_time is None:
            c.finished_time = now
            req.num_unfinished -= 1

    # ---- outputs --------------------------------------------------------------------------------
    def _text(self, c: Completion) -> str:
        if c.detok is not None:
            return c.detok.text
        seq, sp = c.seq, c.seq.sampling_params
        if not sp.detokenize:
            return ""
        ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and not sp.include_stop_str_in_output and ids:
            ids = ids[:-1]  # the EOS / stop token is not part of the text
        return completion_text(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], ids, sp.skip_special_tokens,
                               sp.spaces_between_special_tokens)

    def completion_output(self, c: Completion) -> CompletionOutput:
        seq = c.seq
        ids = seq.completion_token_ids
        lps = None if c.logprobs is None else \
            logprob_dicts(self.tokenizer, zip(ids, c.logprobs), seq.sampling_params.detokenize)
        return CompletionOutput(seq.index, self._text(c), ids, c.cumulative_logprob, lps,
                                seq.finish_reason if seq.is_finished else None, seq.stop_reason)

    def request_output(self, req: Request) -> RequestOutput:
        firsts = [c.first_token_time for c in req.completions if c.first_token_time is not None]
        ends = [c.finished_time for c in req.completions if c.finished_time is not None]
        finished = req.finished
        metrics = RequestMetrics(req.arrival_time, min(firsts, default=None), max(ends) if finished and ends else None)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids),
                             [self.completion_output(c) for c in req.completions], finished, metrics,
                             req.completions[0].num_cached_tokens)

    def take_deltas(self, request_ids) -> list[StreamDelta]:
        """stream_deltas of every request in `request_ids` (a set or dict) with news, in the order their
        news came."""
        deltas = []
        for rid, req in list(self.news.items()):
            if rid in request_ids:
                deltas += self.stream_deltas(req, req.index)
        return deltas

    def stream_deltas(self, req: Request, index: int) -> list[StreamDelta]:
        """What each completion of the request produced since the last call (text is released up to
        a character boundary, minus a possible stop-string prefix)."""
        self.news.pop(req.request_id, None)
        deltas = []
        for c in req.completions:
            seq = c.seq
            done = seq.is_finished
            new_ids = seq.token_ids[seq.num_prompt_tokens + c.streamed_tokens:]  # (not a copy of the whole completion)
            upto = c.detok.releasable(done) if c.detok is not None else 0  # None: detokenize=False
            new_text = c.detok.text[c.streamed_chars:upto] if c.detok is not None else ""
            if c.stream_done or (not new_ids and not new_text and not done):
                continue
            lps = None
            if c.logprobs is not None:
                lps = logprob_dicts(self.tokenizer, zip(new_ids, c.logprobs[c.streamed_tokens:]),
                                    seq.sampling_params.detokenize)
            c.streamed_tokens += len(new_ids)
            c.streamed_chars = max(c.streamed_chars, upto)
            c.stream_done = done
            deltas.append(StreamDelta(index, seq.index, req.request_id, new_text, new_ids, lps, done,
                                      seq.finish_reason if done else None, seq.stop_reason))
        return deltas
