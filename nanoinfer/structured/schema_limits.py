"""Caps on a structured-output spec's nesting depth and size, checked before anything else reads it.

A JSON schema nested a few hundred levels deep is a small request, yet every recursive reader of it
(json.dumps, pickle, Jinja's tojson, xgrammar's parser, whose time grows about cubically with the
depth) fails or stalls on it; a very large spec (a long `choice` list, thousands of tools) makes
an expensive grammar. So each spec is measured here first, iteratively (no recursion, and the walk
stops as soon as a cap is passed: its cost is bounded by the caps, not by the spec).

The caps are process-wide: `SCHEMA_LIMITS`, which StructuredOutputsParams checks when made;
the server sets them from --max-schema-depth / --max-schema-bytes (`configure`) and checks a
request's schema-bearing fields with them before rendering or parsing anything (`check_fields`).
"""
import re
from dataclasses import dataclass

DEFAULT_MAX_SCHEMA_DEPTH = 64        # JSON nesting levels (an object or array is one level)
DEFAULT_MAX_SCHEMA_BYTES = 128 << 10  # a spec's JSON text (or regex, grammar, choices) in bytes

# the JSON text's string literals (skipped when counting brackets)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class SchemaLimits:
    max_depth: int = DEFAULT_MAX_SCHEMA_DEPTH
    max_bytes: int = DEFAULT_MAX_SCHEMA_BYTES

    def __post_init__(self):
        for name in ("max_depth", "max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"max_schema_{name[4:]} must be an int >= 1, got {value!r}")

    def check_value(self, field: str, value) -> None:
        """A dict / list spec: a ValueError naming `field` if it nests deeper than max_depth or
        its JSON text would pass max_bytes (counted as it is walked; a cycle counts as too deep)."""
        size, stack = 0, [(value, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, (dict, list, tuple)):
                if depth > self.max_depth:
                    raise ValueError(f"{field} is nested more than {self.max_depth} levels deep "
                                     "(--max-schema-depth)")
                size += 2 + len(node)  # brackets and separators: a long list is refused before it is walked
                if size > self.max_bytes:
                    break
                if isinstance(node, dict):
                    for key, item in node.items():
                        size += _scalar_size(key) + 1
                        stack.append((item, depth + 1))
                else:
                    stack.extend((item, depth + 1) for item in node)
            else:
                size += _scalar_size(node)
                if size > self.max_bytes:
                    break
        if size > self.max_bytes:
            raise ValueError(f"{field} is larger than {self.max_bytes} bytes (--max-schema-bytes)")

    def check_json_text(self, field: str, text: str) -> None:
        """A spec given as JSON text: its size, then its bracket depth (outside string literals)."""
        self.check_text(field, text)
        depth = deepest = 0
        for bracket in _BRACKETS.finditer(_JSON_STRING.sub("", text)):
            depth += 1 if bracket.group() in "[{" else -1
            if depth > deepest:
                deepest = depth
                if deepest > self.max_depth:
                    raise ValueError(f"{field} is nested more than {self.max_depth} levels deep "
                                     "(--max-schema-depth)")

    def check_text(self, field: str, text: str) -> None:
        """A regex, grammar or JSON text: at most max_bytes (UTF-8; counted without encoding it
        when every character is one byte or the text is clearly too long)."""
        if len(text) > self.max_bytes or (not text.isascii() and len(text.encode("utf-8", "replace")) > self.max_bytes):
            raise ValueError(f"{field} is larger than {self.max_bytes} bytes (--max-schema-bytes)")

    def check_spec(self, field: str, value) -> None:
        """Whatever form a spec field takes: JSON text, a regex or grammar (a field named so), a
        dict / list, or a scalar."""
        if isinstance(value, str):
            if "regex" not in field and "grammar" not in field and value.lstrip()[:1] in ("{", "["):
                self.check_json_text(field, value)
            else:
                self.check_text(field, value)
        else:
            self.check_value(field, value)

    def check_fields(self, fields: dict) -> None:
        """A request's schema-bearing fields (response_format, structured_outputs, guided_*,
        tools, ...: name -> value, None for absent), each checked under its own name."""
        for name, value in fields.items():
            if value is not None:
                self.check_spec(name, value)


def _scalar_size(value) -> int:
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):  # (its digits, without converting a huge int to text)
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, float):
        return len(repr(value))
    return 8  # anything else is refused later (not JSON); it only needs to count


SCHEMA_LIMITS = SchemaLimits()


def configure(max_depth: int = DEFAULT_MAX_SCHEMA_DEPTH, max_bytes: int = DEFAULT_MAX_SCHEMA_BYTES) -> SchemaLimits:
    """Set the process-wide caps (the server does, from its flags); returns them."""
    global SCHEMA_LIMITS
    SCHEMA_LIMITS = SchemaLimits(max_depth, max_bytes)
    return SCHEMA_LIMITS


def schema_limits() -> SchemaLimits:
    return SCHEMA_LIMITS
