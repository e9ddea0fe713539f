"""Request intake: the one place a prompt becomes sequences; every error is a ValueError or
TypeError raised before anything is queued. The registered features check and prepare a request
too (EngineFeature.check_request, before the length checks; .prepare, once its sequences exist).

Heavy intake work the features hand over (a grammar's compile, images' preprocessing) runs in a
small pool of threads, off the engine loop: the request's sequences carry its future
(`Sequence.intake`) and the scheduler admits them once it is done; if it fails, the request
finishes with finish_reason "error", the message as its stop_reason.
"""
import os
from concurrent.futures import Future, ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass
from numbers import Integral

from nanoinfer.config import Config
from nanoinfer.engine.detokenizer import encode
from nanoinfer.step.feature import Intake
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import LOGITS_OPTION_FIELDS, SamplingParams

INTAKE_WORKERS = min(4, os.cpu_count() or 1)  # threads for heavy intake work (they release the GIL in C)


@dataclass(slots=True)
class PreparedRequest:
    """A validated request, not queued yet: its n sequences (one per sample; the first's seq_id is
    the request id) and its prompt text (None for a token-id prompt)."""
    seqs: list[Sequence]
    prompt: str | None


class InputProcessor:
    def __init__(self, config: Config, tokenizer, vocab_size: int, kv_capacity_tokens: int, features=(),
                 sampling_options=()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = config.max_model_len
        self.block_size = config.kvcache_block_size
        self.tensor_parallel = config.tensor_parallel_size > 1
        self.kv_capacity_tokens = kv_capacity_tokens  # every block of the pool
        self.features = features  # asked in order
        self.prompt_keys = frozenset(k for f in features for k in f.prompt_keys)  # a prompt dict's keys they read
        self._workers: ThreadPoolExecutor | None = None  # made for the first heavy intake work
        self.claimed = frozenset(k for o in sampling_options for k in o.off)  # the fields the options serve

    def process_all(self, prompts: list, sampling_params: list, max_tokens_must_fit: bool = False,
                    lora_requests: list | None = None) -> list[PreparedRequest]:
        """`process` each prompt; an error names the prompt's index (when there are several)."""
        prepared = []
        lora_requests = lora_requests if lora_requests is not None else [None] * len(prompts)
        try:
            for i, (prompt, sp, lora) in enumerate(zip(prompts, sampling_params, lora_requests, strict=True)):
                try:
                    prepared.append(self.process(prompt, sp, max_tokens_must_fit, lora))
                except (ValueError, TypeError) as e:
                    if len(prompts) == 1:
                        raise
                    raise type(e)(f"prompts[{i}]: {e}") from e
        except BaseException:
            for request in prepared:  # none is queued: their intake work is not needed
                if request.seqs[0].intake is not None:
                    request.seqs[0].intake.cancel()
            raise
        return prepared

    def process(self, prompt, sampling_params: SamplingParams | None, max_tokens_must_fit: bool = False,
                lora_request=None) -> PreparedRequest:
        """Validate one request and build its n sequences. max_tokens_must_fit: prompt + max_tokens
        over max_model_len is an error (vLLM's OpenAI server) instead of stopping at max_model_len
        (its offline LLM)."""
        prompt, extras = self._split_extras(prompt)
        extras["lora_request"] = lora_request
        text, token_ids = self._tokenize(prompt)
        intake = Intake(token_ids, sampling_params, extras)
        for feature in self.features:
            feature.check_request(intake)
        sampling_params = intake.params if intake.params is not None else SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sp = sampling_params.for_vocabulary(self.vocab_size, self.tensor_parallel)
        for name, off in LOGITS_OPTION_FIELDS.items():
            if name not in self.claimed and getattr(sp, name) != off:
                field = ("allowed_token_ids / logit_bias / bad_words / logits_processors / structured_outputs"
                         if name == "has_token_constraints" else name)
                raise ValueError(f"{field}: this engine runs no sampling option that serves it (its composition "
                                 "registers none: nanoinfer.features.FeatureComposition does)")
        token_ids = self._fit_length(intake.token_ids, sp, max_tokens_must_fit, intake.generates)
        intake.truncated = len(token_ids) != len(intake.token_ids)
        if sp.bad_words:  # (encoded once, here)
            sp = sp.with_bad_words_token_ids(self.tokenizer, self.vocab_size)
        seqs = self._sequences(token_ids, sp)
        intake.seqs, intake.params = seqs, sp
        for feature in self.features:
            feature.prepare(intake)
        if intake.work:
            future = self._run_in_workers(intake.work)
            for seq in seqs:
                seq.intake = future
        return PreparedRequest(seqs, text)

    def _split_extras(self, prompt) -> tuple[object, dict]:
        """A prompt dict's text/token part, and the keys the features read from it."""
        if not isinstance(prompt, dict) or not self.prompt_keys.intersection(prompt):
            return prompt, {}
        return ({k: v for k, v in prompt.items() if k not in self.prompt_keys},
                {k: v for k, v in prompt.items() if k in self.prompt_keys})

    def _run_in_workers(self, work: list) -> Future:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(INTAKE_WORKERS, thread_name_prefix="nanoinfer-intake")
        return self._workers.submit(_run_all, work)

    def close(self):
        """Drop the intake work not started yet (the engine is exiting)."""
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a str, a list of token ids, or a {"prompt", "prompt_token_ids"} dict."""
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or not prompt:
                raise ValueError(f"a prompt dict takes 'prompt' and/or 'prompt_token_ids', got keys {sorted(prompt)}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"a prompt dict's 'prompt' must be a str, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple)):
                    raise TypeError(f"a prompt dict's 'prompt_token_ids' must be a list of ints, "
                                    f"got {type(prompt).__name__}")
            else:
                prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            token_ids = encode(self.tokenizer, prompt)  # a lone surrogate: ValueError
        elif isinstance(prompt, (list, tuple)):
            if set(map(type, prompt)) == {int}:  # the common case, checked without per-token isinstance
                token_ids = list(prompt)
            elif all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
                token_ids = [int(t) for t in prompt]  # numpy / torch integers too
            else:
                raise TypeError("a token-id prompt must be a list of ints")
            if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
                bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        return text, token_ids

    def _fit_length(self, token_ids: list[int], sp: SamplingParams, max_tokens_must_fit: bool,
                    generates: bool) -> list[int]:
        """The prompt, truncated as asked; a ValueError unless it leaves room for an output token
        (`generates`) within max_model_len and prompt + max_tokens fits the whole KV cache."""
        max_len = self.max_model_len
        if sp.truncate_prompt_tokens is not None:  # keep the last k prompt tokens (vLLM)
            keep = sp.truncate_prompt_tokens
            if keep == -1:  # vLLM: the model's length; here the longest prompt that can be admitted
                room = sp.max_tokens if max_tokens_must_fit and sp.max_tokens is not None else 1
                keep = max(1, max_len - room) if generates else max_len  # (too little room: refused below)
            if keep > max_len:
                raise ValueError(f"truncate_prompt_tokens must be at most max_model_len={max_len}, "
                                 f"got {sp.truncate_prompt_tokens}")
            token_ids = token_ids[-keep:]
        # as vLLM's offline LLM: the prompt must leave room for one token; generation stops at
        # max_model_len (finish_reason "length") whatever max_tokens says. An embedding's prompt
        # may fill max_model_len.
        if not generates and len(token_ids) > max_len:
            raise ValueError(f"prompt length {len(token_ids)} exceeds max_model_len={max_len}")
        if generates and len(token_ids) >= max_len:
            raise ValueError(f"prompt length {len(token_ids)} plus at least 1 output token exceeds "
                             f"max_model_len={max_len}: the prompt must be at most {max_len - 1} tokens")
        if max_tokens_must_fit and generates and sp.max_tokens is not None \
                and len(token_ids) + sp.max_tokens > max_len:
            raise ValueError(f"prompt length {len(token_ids)} + max_tokens {sp.max_tokens} = "
                             f"{len(token_ids) + sp.max_tokens} exceeds max_model_len={max_len}")
        total = max_len if sp.max_tokens is None else min(len(token_ids) + sp.max_tokens, max_len)
        if total > self.kv_capacity_tokens:
            raise ValueError(f"prompt length + max_tokens = {total} tokens cannot fit the whole KV cache "
                             f"({self.kv_capacity_tokens} tokens)")
        return token_ids

    def _sequences(self, token_ids: list[int], sp: SamplingParams) -> list[Sequence]:
        """One sequence per sample; sample i > 0 carries the first's seq_id as its request id and,
        with a seed, seed + i (as vLLM: the samples differ)."""
        first = Sequence(token_ids, sp, self.block_size)
        first.computes_whole_prompt = sp.prompt_logprobs is not None  # (no prefix-cache hit: vLLM's rule)
        seqs = [first]
        for i in range(1, sp.n):
            child = sp
            if sp.seed is not None:
                child = copy(sp)  # (not dataclasses.replace: that drops the encoded bad words)
                child.seed = sp.seed + i
            seqs.append(Sequence(token_ids, child, self.block_size, request_id=first.seq_id, index=i))
        return seqs


def _run_all(work: list) -> None:
    for step in work:
        step()

