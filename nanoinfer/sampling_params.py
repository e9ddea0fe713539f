"""Per-request sampling options, validated at construction.

Fields, defaults and rules follow vLLM's `SamplingParams` (except `max_tokens`, which defaults to 64
as in nano-vllm). Every violation raises a ValueError naming the field, the value and the allowed
range, or a TypeError naming the field and the expected type.
"""
import copy
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral, Real

from nanoinfer.structured.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "SAMPLING_EPS"]

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by them could overflow.
SAMPLING_EPS = 1e-5
# The fields a request sets only through a per-request logits option (sampling/option.py), with
# their off values: an engine whose registered options serve none of a field set here refuses the
# request instead of ignoring it. (has_token_constraints: any per-token-id option or a grammar.)
LOGITS_OPTION_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                        "min_tokens": 0, "has_token_constraints": False}


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)  # numpy / torch integers too


def _is_number(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _to_float(v: Real) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond float range
        return math.inf if v > 0 else -math.inf


@dataclass
class SamplingParams:
    """n: completions per prompt (they share the prompt's KV blocks).
    temperature: 0 (or < 1e-5) = greedy. top_p in (0, 1]; top_k 0 or -1 = off, else >= 1;
    min_p in [0, 1] (tokens below min_p x the top token's probability are dropped).
    presence_penalty / frequency_penalty in [-2, 2] (on generated tokens); repetition_penalty > 0
    (on prompt and generated tokens; 1 = off).
    seed: a seeded request samples the same tokens whatever else shares its batch.
    stop: strings that end the completion (cut from the text unless include_stop_str_in_output);
    stop_token_ids: token ids that end it. ignore_eos: keep going past EOS.
    max_tokens: completion length cap (None = up to max_model_len); min_tokens: EOS and stop token
    ids are suppressed until this many tokens were generated.
    logprobs: the top-N log-probabilities per generated token, plus the sampled token's (computed
    from the model's raw logits, as vLLM does). prompt_logprobs: the same for every prompt token
    but the first (RequestOutput.prompt_logprobs; the request skips the prefix cache, as in vLLM).
    logit_bias: {token id: bias} added to the logits (clamped to [-100, 100], as vLLM does).
    allowed_token_ids: only these tokens may be sampled. bad_words: words never generated: the
    last token of each word's encoding (with and without a leading space) is banned wherever the
    tokens before it were just generated. logits_processors: callables
    `(output_token_ids, logits_row) -> logits_row` (or `(prompt_token_ids, output_token_ids,
    logits_row)`), run on this request's row before sampling; one that raises fails this request
    alone (finish_reason "error", the error logged), where vLLM's engine would fail every request.
    Options that leave no token to sample (allowed_token_ids or bad_words that exclude everything
    structured_outputs allows) also finish the request with finish_reason "error".
    skip_special_tokens: drop special tokens from text; spaces_between_special_tokens: put spaces
    around them (tokenizers that support it). detokenize=False: no text (token ids only; no stop
    strings). truncate_prompt_tokens: keep only the last k prompt tokens (-1: max_model_len).
    structured_outputs: a StructuredOutputsParams (JSON schema, regex, choice, grammar, any JSON
    object): the output is constrained to match it, and ends (finish_reason "stop") when it is
    complete. Needs xgrammar (pip install nanoinfer[structured])."""
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 64
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Callable] | None = None
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # set by the engine from `bad_words` and its tokenizer (vLLM's _bad_words_token_ids)
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_types()
        self._check_ranges()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:  # clamped as vLLM (and OpenAI) do
            self.logit_bias = {int(t): min(100.0, max(-100.0, _to_float(b))) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.logits_processors is not None:
            self.logits_processors = list(self.logits_processors)
        # any per-token-id feature: the sampler's loop over the batch checks this one flag
        self.has_token_constraints = bool(self.logit_bias) or self.allowed_token_ids is not None \
            or bool(self.bad_words) or bool(self.logits_processors) or self.structured_outputs is not None
        if self.temperature < SAMPLING_EPS:  # greedy: the filters mean nothing (as vLLM resets them)
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_types(self):
        """Any numbers.Integral (not bool) for ints and numbers.Real for floats, stored as int / float."""
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {type(getattr(self, name)).__name__}")
            setattr(self, name, int(getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a float, got {type(getattr(self, name)).__name__}")
            setattr(self, name, _to_float(getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise TypeError(f"{name} must be an int or None, got {type(v).__name__}")
            setattr(self, name, None if v is None else int(v))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise TypeError(f"stop must be a str, a list of str or None, got {stop!r}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids)):
            raise TypeError(f"stop_token_ids must be a list of int or None, got {ids!r}")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or not all(_is_int(t) and _is_number(b)
                                                                      for t, b in bias.items())):
            raise TypeError(f"logit_bias must be a dict of int token id -> float bias or None, got {bias!r}")
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids)):
            raise TypeError(f"allowed_token_ids must be a list of int or None, got {ids!r}")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words)):
            raise TypeError(f"bad_words must be a list of str or None, got {words!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams or None, got {type(so).__name__}")
        procs = self.logits_processors
        if procs is not None and (not isinstance(procs, (list, tuple)) or not all(callable(f) for f in procs)):
            raise TypeError(f"logits_processors must be a list of callables or None, got {procs!r}")

    def _check_ranges(self):
        def fail(name, allowed):
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        inf = float("inf")
        if self.n < 1:
            fail("n", "at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty < inf:
            fail("repetition_penalty", "in (0, inf)")
        if not 0.0 <= self.temperature < inf:
            fail("temperature", "non-negative and finite (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "0 or -1 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            fail("seed", "None or an int64, in [-2**63, 2**63 - 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "at least 1")
        if self.min_tokens < 0:
            fail("min_tokens", "at least 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < -1:
            fail("logprobs", "None, -1 (the whole vocabulary) or at least 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            fail("prompt_logprobs", "None, -1 (the whole vocabulary) or at least 0")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            fail("truncate_prompt_tokens", "None, -1 (max_model_len) or at least 1")
        if self.logit_bias and any(t < 0 for t in self.logit_bias):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {sorted(self.logit_bias)[:5]!r}")
        if self.logit_bias and any(math.isnan(_to_float(b)) for b in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be numbers, not NaN, got {self.logit_bias!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be non-negative token ids, got {self.allowed_token_ids!r}")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must not contain an empty or blank word, got {self.bad_words!r}")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (the text); use stop_token_ids with detokenize=False")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(s == "" for s in stops):
            raise ValueError(f"stop must not contain an empty string, got {self.stop!r}")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_host_tokens(self) -> bool:
        """Building this request's next step needs every earlier token on the host (logits
        processors read them; a bad word of several tokens is matched against them; a grammar
        advances over them before it masks the next token), so with overlapped steps it runs every
        other step, unless only its grammar needs them (needs_host_tokens_to_launch). Single-token
        bad words need nothing."""
        return self.needs_host_tokens_to_launch or self.structured_outputs is not None

    @property
    def needs_host_tokens_to_launch(self) -> bool:
        """needs_host_tokens, less a grammar: the engine fills a grammar's mask after launching the
        step's forward, once the previous step's token has reached the host
        (structured/step_masks.py), so a structured request alone runs every step."""
        return bool(self.logits_processors) or self._has_multi_token_bad_words()

    def _has_multi_token_bad_words(self) -> bool:
        """Whether a bad word encodes to several tokens: read once per bad_words_token_ids list (the
        scheduler asks every step)."""
        words = self.bad_words_token_ids
        if not words:
            return False
        cached = self.__dict__.get("_multi_token_words")
        if cached is None or cached[0] is not words:
            cached = self.__dict__["_multi_token_words"] = (words, any(len(w) > 1 for w in words))
        return cached[1]

    def with_bad_words_token_ids(self, tokenizer, vocab_size: int | None = None) -> "SamplingParams":
        """A copy with `bad_words` encoded by vLLM's rule: each word with and without a leading
        space; the spaced variant only when it is a different word of as many tokens. With
        `vocab_size`, a word that encodes to ids outside the model's vocabulary is a ValueError."""
        sp = copy.copy(self)
        sp.bad_words_token_ids = []
        for word in self.bad_words or ():
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sp.bad_words_token_ids.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sp.bad_words_token_ids.append(spaced)
        bad = [t for word in sp.bad_words_token_ids for t in word if vocab_size is not None and not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"bad_words encode to token ids outside [0, {vocab_size}): {bad[:5]}")
        return sp

    def for_vocabulary(self, vocab_size: int, processors_sent: bool = False) -> "SamplingParams":
        """What these params cannot check on their own, checked against the model's vocabulary:
        token ids and logprob counts in range, and (`processors_sent`: they run in a worker
        process, tensor parallelism) logits processors picklable. logprobs / prompt_logprobs = -1
        (the whole vocabulary, vLLM) are resolved in a copy: this object may be shared by other
        prompts."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", self.logit_bias)):
            bad = [t for t in ids or () if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {bad[:5]}")
        if self.logits_processors and processors_sent:
            try:  # sent with each step (a fresh copy each time: state a processor keeps is not kept there)
                pickle.dumps(self.logits_processors)
            except Exception as e:
                raise ValueError("logits_processors must be picklable with tensor_parallel_size > 1 (they run in "
                                 f"the sampling worker process; define them at module level): {e}") from None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, got {getattr(self, name)}")
        if self.logprobs != -1 and self.prompt_logprobs != -1:
            return self
        sp = copy.copy(self)
        sp.logprobs = vocab_size if sp.logprobs == -1 else sp.logprobs
        sp.prompt_logprobs = vocab_size if sp.prompt_logprobs == -1 else sp.prompt_logprobs
        return sp
