"""A structured request's intake: its grammar, compiled once per spec, and one matcher per sample.

`prepare` takes a cache hit at once (the sequences get their matchers there); otherwise it returns
the work to do, which the input processor runs in an intake worker while the sequences wait
(Sequence.intake): a large grammar's compile never holds the engine loop.
"""
from collections.abc import Callable

from nanoinfer.structured.compiler import DEFAULT_CACHE_BYTES, StructuredCompiler
from nanoinfer.structured.grammar_state import GrammarState
from nanoinfer.structured.params import StructuredOutputsParams


class GrammarIntake:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.compiler = StructuredCompiler(tokenizer, vocab_size, stop_token_ids, cache_bytes)

    def prepare(self, params: StructuredOutputsParams, seqs: list) -> Callable[[], None] | None:
        """Give each sequence its GrammarState now (a cached grammar: returns None), or return the
        work that compiles the grammar and then gives them theirs."""
        compiled = self.compiler.lookup(params)
        if compiled is not None:
            self._attach(compiled, seqs)
            return None
        return lambda: self._attach(self.compiler.compile(params), seqs)

    def _attach(self, compiled, seqs: list) -> None:
        for seq in seqs:  # one matcher per sample; it lives and dies with its sequence
            seq.grammar = GrammarState(compiled, self.compiler.stop_token_ids)
