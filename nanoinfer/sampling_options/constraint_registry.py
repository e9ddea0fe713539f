"""The engine's side of the token constraints kept on the sampling rank's device.

A request's allowed_token_ids, logit_bias and one-token bad words do not change while it runs, yet
a step needs them for each of its rows. So they are read once per SamplingParams object (the n
samples of a request share theirs, and so may the prompts of one generate() call) into
TokenConstraints, sent to the rank that samples with the first step that uses them, and from then
on named by an integer key: a step's host cost is a key per row, whatever the sizes (the rank's
side: constraint_store.py). When the SamplingParams object is garbage collected (every
sequence using it is gone: finished, aborted), its key goes out with the next plan as dropped, and
the rank frees its tensors. A SamplingParams whose constraint fields were replaced since gets a new
key. Multi-token bad words depend on the tokens just generated: they are indexed once per object
too (by the tokens before the banned one), so a step looks up a row's last tokens instead of
comparing every word.
"""
import weakref
from array import array
from dataclasses import dataclass
from itertools import count

_keys = count(1)  # one counter for every registry of the process: a key is never reused


@dataclass(slots=True)
class TokenConstraints:
    """A request's token constraints that do not depend on its progress, as C arrays (they pickle
    as bytes): allowed_token_ids, logit_bias (ids and float32 values) and the one-token bad words.
    Sent once to the rank that samples, which keeps them on its device under a key
    (constraint_store.py); a step then names them by key. None: the request has none."""
    allowed: array | None = None       # 'q'
    bias_ids: array | None = None      # 'q'
    bias_values: array | None = None   # 'f'
    banned: array | None = None        # 'q'


def token_constraints(sp) -> TokenConstraints | None:
    """The constraints of `sp` that do not depend on its progress, or None when it has none."""
    c = TokenConstraints()
    if sp.allowed_token_ids is not None:
        c.allowed = array("q", sp.allowed_token_ids)
    if sp.logit_bias:
        c.bias_ids = array("q", sp.logit_bias.keys())
        c.bias_values = array("f", sp.logit_bias.values())
    one_token = [w[0] for w in sp.bad_words_token_ids or () if len(w) == 1]
    if one_token:
        c.banned = array("q", one_token)
    if c.allowed is None and c.bias_ids is None and c.banned is None:
        return None
    return c


def bad_word_index(sp) -> dict[int, dict[tuple, list[int]]]:
    """The multi-token bad words of `sp`: for each count k of tokens before the banned one, those
    k tokens -> the tokens they ban next."""
    index: dict[int, dict[tuple, list[int]]] = {}
    for word in sp.bad_words_token_ids or ():
        if len(word) > 1:
            index.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
    return index


def banned_after(index: dict[int, dict[tuple, list[int]]], token_ids: list[int], num_prompt: int) -> list[int]:
    """vLLM's rule for words of several tokens: a word's last token is banned when the output ends
    with the tokens before it. One lookup per distinct word length."""
    banned = []
    num_output = len(token_ids) - num_prompt
    for k, words in index.items():
        if k <= num_output:
            banned += words.get(tuple(token_ids[len(token_ids) - k:]), ())
    return banned


class _Entry:
    __slots__ = ("key", "fields", "constraints", "words", "sent")

    def __init__(self, sp):
        self.key = next(_keys)
        self.fields = _fields(sp)
        self.constraints = token_constraints(sp)
        self.words = bad_word_index(sp)
        self.sent = False


def _fields(sp) -> tuple:
    return sp.allowed_token_ids, sp.logit_bias, sp.bad_words_token_ids


class TokenConstraintRegistry:
    """One per sampling rank's store (the engine's StepEncoder; a draft model's proposer).
    `ephemeral`: a registry for one plan only (tests, benchmarks): every key it sends is dropped
    again after that step. `store`: the store itself, when it is in this process (a draft model's
    runner): what it holds is read there, and dropped keys are freed there at once, so a launch that
    fails needs no unschedule()."""

    def __init__(self, ephemeral: bool = False, store=None):
        self.ephemeral = ephemeral
        self._store = store
        self._entries: dict[int, _Entry] = {}  # id(SamplingParams) -> its entry, while the object lives
        self._new: dict[int, _Entry] = {}  # key -> the entries the next plan sends
        self._dropped: list[int] = []  # keys whose SamplingParams are gone (appended by finalizers)
        self._last: tuple[list[_Entry], list[int]] = ([], [])  # the last plan's sent entries and drops
        self._plan_keys: dict[int, int | None] = {}  # id(SamplingParams) -> key, for the plan being built

    def _entry(self, sp) -> _Entry:
        e = self._entries.get(id(sp))
        if e is None:
            e = self._entries[id(sp)] = _Entry(sp)
            if not self.ephemeral:
                weakref.finalize(sp, self._forget, id(sp))
        elif e.fields[0] is not sp.allowed_token_ids or e.fields[1] is not sp.logit_bias \
                or e.fields[2] is not sp.bad_words_token_ids:  # a field was replaced: anew
            self._forget(id(sp))
            e = self._entries[id(sp)] = _Entry(sp)
        return e

    @property
    def pending(self) -> bool:
        """Keys to drop are waiting for the next plan."""
        return bool(self._dropped)

    def start_plan(self) -> None:
        """A plan is being built (the last one may have raised before take_updates)."""
        self._plan_keys.clear()

    def key_for(self, sp) -> int | None:
        """The key of the constraints of `sp` (None: it has none); the next plan sends them if the
        rank has not got them."""
        key = self._plan_keys.get(id(sp), 0)  # (the rows of a request share their SamplingParams)
        if key != 0:
            return key
        e = self._entry(sp)
        key = None if e.constraints is None else e.key
        if key is not None and not (e.sent if self._store is None else key in self._store.held):
            self._new[key] = e
        self._plan_keys[id(sp)] = key
        return key

    def banned_after(self, sp, token_ids: list[int], num_prompt: int) -> list[int]:
        """The tokens the multi-token bad words of `sp` ban next, after these tokens."""
        return banned_after(self._entry(sp).words, token_ids, num_prompt)

    def take_updates(self) -> tuple[dict | None, list[int] | None]:
        """For the plan being built: the constraints to send and the keys to drop (None: none)."""
        new, self._new = self._new, {}
        dropped, self._dropped = self._dropped, []
        self._plan_keys.clear()
        for e in new.values():
            e.sent = True
        if self.ephemeral:
            dropped = dropped + list(new)
            self._entries.clear()
        elif self._store is not None:
            self._store.drop(dropped)
            dropped = []
        self._last = (list(new.values()), dropped)
        return {k: e.constraints for k, e in new.items()} or None, dropped or None

    def unschedule(self) -> None:
        """The last plan was not launched: what it sent and dropped goes with the next one."""
        sent, dropped = self._last
        for e in sent:
            e.sent = False
        self._dropped.extend(dropped)
        self._last = ([], [])

    def _forget(self, sp_id: int) -> None:
        """The SamplingParams object is gone (a finalizer, maybe on another thread), or its fields
        were replaced. Its key is dropped even if its last send was undone: the rank ignores a key
        it does not hold."""
        e = self._entries.pop(sp_id, None)
        if e is not None and e.constraints is not None:
            self._new.pop(e.key, None)
            self._dropped.append(e.key)
