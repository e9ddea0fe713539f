"""Grammar compilation, once per engine and once per spec.

A GrammarCompiler precomputes, for every grammar, which tokens of the vocabulary each grammar
state may take; that is the expensive part (it scales with the vocabulary and the grammar), so a
compiled grammar is cached by its spec's digest (StructuredOutputsParams.cache_key), least
recently used dropped once the cache holds more than `cache_bytes` of compiled grammars (their own
size, as xgrammar reports it: entries differ by orders of magnitude). Compiling runs in the
engine's intake workers (structured/intake.py; xgrammar releases the GIL meanwhile), never in the
engine loop; only a cache hit is taken at intake.

The TokenizerInfo uses the model's vocabulary size, which may be wider than the tokenizer's
(padded embeddings): the extra ids are never allowed. Its stop tokens are the engine's EOS ids, so
a finished grammar allows only tokens on which the scheduler stops the sequence.
"""
import os
import threading
from collections import OrderedDict

from nanoinfer.structured.params import StructuredOutputsParams
from nanoinfer.structured.xgrammar_import import import_xgrammar

DEFAULT_CACHE_BYTES = 512 << 20  # vLLM's VLLM_XGRAMMAR_CACHE_MB default
ENTRY_OVERHEAD_BYTES = 256       # the key and the entry themselves


class GrammarCache:
    """Compiled grammars by key, least recently used first, bounded by their total size in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict = OrderedDict()  # key -> (compiled, size)
        self._lock = threading.Lock()  # intake threads and the engine loop both look

    def get(self, key):
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key, compiled, size: int) -> None:
        size += ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return  # larger than the whole cache: used once, not kept
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[key] = (compiled, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


class StructuredCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_bytes: int = DEFAULT_CACHE_BYTES):
        xgr = import_xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=self.stop_token_ids)
        # xgrammar's own cache is keyed by the spec's text: ours, by digest and bounded in bytes
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                            cache_enabled=False)
        self.cache = GrammarCache(cache_bytes)

    def lookup(self, params: StructuredOutputsParams):
        """The cached CompiledGrammar of `params`, or None (cheap: for the engine loop)."""
        return self.cache.get(params.cache_key())

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of `params` (cached); a ValueError naming the field if xgrammar
        refuses it. Expensive: called in an intake worker."""
        key = params.cache_key()
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        kind, text = params.grammar_spec()
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=not params.disable_any_whitespace)
            elif kind == "json_object":  # an object, as vLLM means it (the builtin grammar takes any value)
                compiled = self.compiler.compile_json_schema('{"type": "object"}',
                                                             any_whitespace=not params.disable_any_whitespace)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "grammar":
                compiled = self.compiler.compile_grammar(text)
            else:
                compiled = self.compiler.compile_structural_tag(text)
        except Exception as e:
            raise ValueError(f"structured_outputs.{params.kind} could not be compiled: {e}") from None
        self.cache.put(key, compiled, compiled.memory_size_bytes)
        return compiled
