"""StructuredOutputsParams: what a request's output must match (vLLM's names and rules).

Exactly one kind is set: `json` (a JSON schema, a dict or its JSON text), `regex`, `choice` (one of
these strings), `grammar` (EBNF / GBNF, root rule `root`), `json_object=True` (any JSON object) or
`structural_tag` (xgrammar's structural tag, a dict or its JSON text). `disable_any_whitespace`:
JSON without free whitespace between tokens (compact output).

The spec is checked here, when the request is made (a bad schema, regex or grammar is a ValueError
naming the field): first its depth and size against the process-wide caps (schema_limits.py),
before anything else reads it, then by parsing it with xgrammar (cheap within the caps); compiling
it against the tokenizer, the expensive part, runs in the engine's intake workers
(structured/intake.py).
"""
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from nanoinfer.structured.schema_limits import schema_limits
from nanoinfer.structured.xgrammar_import import import_xgrammar

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {set_kinds or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError("structured_outputs.disable_any_whitespace must be a bool, "
                            f"got {type(self.disable_any_whitespace).__name__}")
        kind = set_kinds[0]
        value = getattr(self, kind)
        limits = schema_limits()  # before anything recurses into the spec
        if kind in ("regex", "grammar") and isinstance(value, str):
            limits.check_text(f"structured_outputs.{kind}", value)
        elif kind != "json_object":
            limits.check_spec(f"structured_outputs.{kind}", value)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.{kind} is not valid JSON: {e}") from None
            elif isinstance(value, dict):
                parsed = value
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"structured_outputs.{kind} must be JSON-serialisable: {e}") from None
            else:
                raise TypeError(f"structured_outputs.{kind} must be a dict or a JSON str, got {type(value).__name__}")
            if not isinstance(parsed, (dict, bool)) or (kind == "structural_tag" and not isinstance(parsed, dict)):
                raise ValueError(f"structured_outputs.{kind} must be a JSON object, got {value!r:.80}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str):
                raise TypeError(f"structured_outputs.{kind} must be a str, got {type(value).__name__}")
            if not value:
                raise ValueError(f"structured_outputs.{kind} must not be empty")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
                raise TypeError(f"structured_outputs.choice must be a list of str, got {value!r:.80}")
            if not value or any(c == "" for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r:.80}")
            object.__setattr__(self, "choice", list(value))
        elif value is not True:
            raise TypeError(f"structured_outputs.json_object must be a bool, got {type(value).__name__}")
        import_xgrammar()  # (a clear ImportError without it, for every kind)
        _check_spec(kind, *self.grammar_spec(), not self.disable_any_whitespace)  # a bad spec fails here

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """What identifies the compiled grammar: the kind and a digest of the spec (JSON specs as
        compact JSON text, keys kept in their order: a schema's property order is the output's).
        A digest, so that a cache of many large specs does not hold their text."""
        value = getattr(self, self.kind)
        if isinstance(value, str) and self.kind in ("json", "structural_tag"):
            value = json.loads(value)
        if isinstance(value, dict):
            value = json.dumps(value, separators=(",", ":"))
        elif isinstance(value, list):
            value = json.dumps(value)
        return self.kind, _digest(str(value)), self.disable_any_whitespace

    def grammar_spec(self) -> tuple[str, str]:
        """(kind, text) as the grammar compiler takes it: dicts as JSON text, choice as an EBNF
        alternation (kind "grammar")."""
        kind = self.kind
        value = getattr(self, kind)
        if isinstance(value, dict):
            value = json.dumps(value)
        if kind == "choice":
            return "grammar", choice_grammar(self.choice)
        return kind, value


CHECKED_SPECS = 1024  # digests of specs that parsed, remembered: a server sees the same few again and again
_checked: OrderedDict = OrderedDict()
_checked_lock = threading.Lock()


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _check_spec(field: str, kind: str, text, any_whitespace: bool) -> None:
    """Parse the spec into an xgrammar Grammar (no tokenizer needed): a ValueError naming the field
    if xgrammar refuses it. Specs that parsed are remembered by digest (a bounded set)."""
    if kind not in ("json", "regex", "grammar", "structural_tag"):
        return  # (json_object: a fixed grammar)
    key = (kind, _digest(text), any_whitespace)
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    _parse_spec(field, kind, text, any_whitespace)
    with _checked_lock:
        _checked[key] = None
        while len(_checked) > CHECKED_SPECS:
            _checked.popitem(last=False)


def _parse_spec(field: str, kind: str, text, any_whitespace: bool) -> None:
    xgr = import_xgrammar()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
    except Exception as e:  # xgrammar raises RuntimeError (and its own errors) for a bad spec
        raise ValueError(f"structured_outputs.{field} is invalid: {_first_line(e)}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF rule matching exactly one of the strings (quotes and backslashes escaped; other
    characters as JSON escapes, which xgrammar's string literals read)."""
    alts = [json.dumps(c, ensure_ascii=False) for c in choices]
    return "root ::= " + " | ".join(alts)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__
