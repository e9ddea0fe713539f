"""Grammar compilation, once per engine and once per spec.

A GrammarCompiler precomputes, for every grammar, which tokens of the vocabulary each grammar
state may take; that is the expensive part (it scales with the vocabulary and the grammar), so a
compiled grammar is cached by its spec (StructuredOutputsParams.cache_key), least recently used
dropped beyond CACHE_SIZE. It runs at request intake: in the caller's thread offline, in the
engine process under the server (a large schema's first compile holds that process's loop).

The TokenizerInfo uses the model's vocabulary size, which may be wider than the tokenizer's
(padded embeddings): the extra ids are never allowed. Its stop tokens are the engine's EOS ids, so
a finished grammar allows only tokens on which the scheduler stops the sequence.
"""
import os
import threading
from collections import OrderedDict

from nanoinfer.structured.params import StructuredOutputsParams
from nanoinfer.structured.xgrammar_import import import_xgrammar

CACHE_SIZE = 256  # compiled grammars kept per engine


class StructuredCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        xgr = import_xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=self.stop_token_ids)
        # xgrammar's own cache has no entry bound by default: ours is bounded instead
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                            cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # add_request may run on several threads

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of `params` (cached); a ValueError naming the field if xgrammar
        refuses it."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
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
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
