"""Structured outputs (xgrammar): constrain a request's output to a JSON schema, a regex, a choice
of strings or a grammar, and the OpenAI-server helpers around them (response_format, tools).

    schema_limits.py  caps on a spec's nesting depth and size, checked first (iteratively)
    params.py         StructuredOutputsParams (vLLM's names), checked when made
    compiler.py       one GrammarCompiler per engine, compiled grammars cached by spec digest (bounded in bytes)
    intake.py         a request's grammar: a cache hit at once, else compiled in an intake thread
    grammar_state.py  one GrammarMatcher per sequence, advanced when a step's masks are filled
    step_masks.py     a step's masks filled while its forward runs
    feature.py        the engine hooks: intake, and a step's masks between its launch and its sampling
    openai.py         response_format / vLLM extra fields / tools + tool_choice -> StructuredOutputsParams
    tool_calls.py     the model's tool-call text -> OpenAI tool_calls
"""
from nanoinfer.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
