"""User conveniences over the engine loop: generate, chat, stream (vLLM's offline `LLM` API)."""
from collections.abc import Iterator
from numbers import Integral

from tqdm.auto import tqdm

from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.outputs import RequestOutput, StreamDelta


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and \
        all(isinstance(t, Integral) and not isinstance(t, bool) for t in x)


class LLM(LLMEngine):
    # ---- public API -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a str, a list of token ids, a {"prompt": str} / {"prompt_token_ids": [...]} dict,
        or a list of those. sampling_params: one SamplingParams for all prompts (None: defaults),
        or a list with one per prompt. Every request is validated before any is queued: a bad one
        adds none. Returns one RequestOutput per prompt, in prompt order; `out["text"]` and
        `out["token_ids"]` give its first completion's text and token ids (nano-vllm style)."""
        items, params = self._normalize(prompts, sampling_params)
        request_ids = self._add_all(items, params, incremental=False)
        return self._run_to_completion(request_ids, use_tqdm)

    def chat(self, messages, sampling_params=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
        Each is rendered with the tokenizer's chat template (or `chat_template`) and generated;
        returns one RequestOutput per conversation."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: pass chat_template=... (a Jinja template) "
                             "or use generate() with plain prompts")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) "
                            "or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not conv or not all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise TypeError(f"a conversation must be a non-empty list of dicts with 'role' and 'content', "
                                f"got {conv!r:.200}")
            text = self.tokenizer.apply_chat_template(
                list(conv), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=False, **(chat_template_kwargs or {}))
            # the template writes every special token itself
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamDelta]:
        """Generate like `generate` (same prompts and sampling_params), yielding increments as the
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
        items, params = self._normalize(prompts, sampling_params)
        groups = [self.make_request(prompt, sp) for (_, prompt), sp in zip(items, params)]  # raises now
        return self._stream(items, groups)

    def _stream(self, items, groups) -> Iterator[StreamDelta]:
        request_ids = [self.add_sequences(seqs, text, collect=True, incremental=True)
                       for (text, _), seqs in zip(items, groups)]
        index = {rid: i for i, rid in enumerate(request_ids)}
        pending = list(request_ids)
        proc = self.output_processor
        try:
            while pending:
                if self.is_finished() and not all(proc.requests[r].finished for r in pending):
                    raise RuntimeError("the engine has no work left but requests are unfinished")
                self.step()
                for rid in list(pending):
                    deltas = proc.stream_deltas(rid, index[rid])
                    req = proc.requests[rid]
                    if req.finished and all(c.stream_done for c in req.completions):
                        if deltas:
                            deltas[-1].output = proc.request_output(rid)
                        proc.drop(rid)
                        pending.remove(rid)
                    yield from deltas
        finally:
            for rid in request_ids:
                if rid in proc.requests:
                    self.abort_request(rid)
                    proc.drop(rid)

    # ---- helpers --------------------------------------------------------------------------------
    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids, a dict, or a list of those, "
                            f"got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one SamplingParams or a list of the same length")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        items = []
        for p in prompts:
            if isinstance(p, dict):
                unknown = set(p) - {"prompt", "prompt_token_ids"}
                if unknown or not p:
                    raise ValueError(f"a prompt dict takes 'prompt' and/or 'prompt_token_ids', got keys {sorted(p)}")
                text = p.get("prompt")
                # checked here: make_sequence would tokenize a str of ids, and keep a non-str prompt
                if text is not None and not isinstance(text, str):
                    raise TypeError(f"a prompt dict's 'prompt' must be a str, got {type(text).__name__}")
                if "prompt_token_ids" in p and not isinstance(p["prompt_token_ids"], (list, tuple)):
                    raise TypeError(f"a prompt dict's 'prompt_token_ids' must be a list of ints, "
                                    f"got {type(p['prompt_token_ids']).__name__}")
                items.append((text, p["prompt_token_ids"] if "prompt_token_ids" in p else text))
            else:
                items.append((p if isinstance(p, str) else None, p))
        return items, params

    def _add_all(self, items, params, incremental: bool) -> list[int]:
        # Validate every request before queueing any: a bad one adds none of them.
        groups = [self.make_request(prompt, sp) for (_, prompt), sp in zip(items, params)]
        return [self.add_sequences(seqs, text, collect=True, incremental=incremental)
                for (text, _), seqs in zip(items, groups)]

    def _run_to_completion(self, request_ids: list[int], use_tqdm: bool) -> list[RequestOutput]:
        proc = self.output_processor
        position = {rid: i for i, rid in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        left = len(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        in_tokens = out_tokens = 0

        def collect(rid):
            nonlocal left, in_tokens, out_tokens
            out = proc.request_output(rid)
            proc.drop(rid)
            results[position[rid]] = out
            left -= 1
            in_tokens += len(out.prompt_token_ids)
            out_tokens += sum(len(c.token_ids) for c in out.outputs)
            if use_tqdm:
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                               f"output: {out_tokens / elapsed:.2f} toks/s")
                bar.update(1)

        try:
            while left:
                if self.is_finished():  # whatever is left was aborted
                    for rid in request_ids:
                        if results[position[rid]] is None:
                            collect(rid)
                    break
                finished, _ = self.step()
                done = {proc.by_seq[seq_id].request.request_id for seq_id, _ in finished if seq_id in proc.by_seq}
                if proc.aborted_ids:  # aborted meanwhile (another thread): report them too
                    done |= proc.aborted_ids & position.keys()
                for rid in done:
                    if rid in position and results[position[rid]] is None and proc.requests[rid].finished:
                        collect(rid)
        except BaseException:
            for rid in request_ids:  # leave the engine clean for the next call
                self.abort_request(rid)
                proc.drop(rid)
            raise
        finally:
            bar.close()
        return results
