"""LLM.stream: generate's requests, their text and tokens yielded as the engine loop produces them."""
from collections.abc import Iterator

from nanoinfer.outputs import StreamDelta


class StreamAPI:
    """Mixed into LLM: uses its add_requests / advance / take_stream_deltas / pop_output and prompt
    normalisation."""

    def stream(self, prompts, sampling_params=None, lora_request=None, priority=None) -> Iterator[StreamDelta]:
        """Generate like `generate` (same prompts, sampling_params, lora_request and priority), yielding increments as the
        engine loop produces them: each `StreamDelta` holds, for one completion of one prompt,
        `index` (the prompt's position in `prompts`), `completion_index` (which of its n samples),
        `request_id`, the new `text` and `token_ids` since its previous delta, their `logprobs`
        (when asked), and `finished` / `finish_reason` / `stop_reason`. Text is released on
        character boundaries, and text that may be the start of a stop string is held back until
        it is known not to be one, so the concatenated deltas of a completion equal its final
        text (and its token-id deltas its token ids). When all of a prompt's completions are done,
        the last delta carries the full RequestOutput in `output`. Closing the generator early
        aborts the requests still running. Runs on the calling thread, one engine step per
        iteration; other requests queued on the engine progress too."""
        if self._replicas is not None:
            raise NotImplementedError("stream() runs on one engine: make the LLM with data_parallel_size=1, or "
                                      "stream from `nanoinfer serve --data-parallel-size N`")
        prompts, params = self._normalize(prompts, sampling_params)
        loras = self._lora_requests(lora_request, len(prompts))
        with self.driving():  # before queuing, as generate(): another thread driving queues nothing
            request_ids = self.add_requests(prompts, params, stream=True, keep_output=True,
                                            lora_requests=loras, priority=priority)  # raises now
        return self._stream(request_ids, [sp.n if sp is not None else 1 for sp in params])

    def _stream(self, request_ids, ns) -> Iterator[StreamDelta]:
        left = dict(zip(request_ids, ns))  # completions of each request not finished yet
        try:
            while left:
                with self.driving():  # while it runs, not while it waits between yields
                    deltas = self._next_deltas(left)
                yield from deltas
        finally:
            for rid in left:
                self.pop_output(rid)  # aborts what still runs

    def _next_deltas(self, left: dict) -> list[StreamDelta]:
        """The next deltas of the requests in `left` (advancing the engine if none are pending);
        a request's last one carries its output, and the request leaves `left`."""
        deltas = self.take_stream_deltas(left)  # news made while another caller drove the engine
        if not deltas:
            if self.is_finished():
                raise RuntimeError("the engine has no work left but requests are unfinished")
            self.advance()
            deltas = self.take_stream_deltas(left)  # index: the position in request_ids
        for d in deltas:  # (a request's deltas are together, its completions in order)
            if d.finished:
                left[d.request_id] -= 1
                if not left[d.request_id]:
                    d.output = self.pop_output(d.request_id)
                    del left[d.request_id]
        return deltas
