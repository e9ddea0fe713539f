"""The engine core names no feature: features attach through the hooks of step/feature.py, which
the engine calls in order at fixed points, with the composition chosen above it."""
import ast
import pathlib

import pytest

from nanoinfer import SamplingParams
from nanoinfer.step.feature import EngineFeature
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.features import FeatureComposition

FEATURE_PACKAGES = ("lora", "spec", "speculative", "structured", "pooling", "multimodal", "quant", "prompt_logprobs",
                    "data_parallel", "serve", "priority", "metrics", "expert_parallel", "sampling_options",
                    "batch_invariant")


def test_the_core_imports_no_feature_package():
    """Every import in engine/, sampling/ and step/, at the top of a file or inside a function."""
    package = pathlib.Path(__file__).parent.parent / "nanoinfer"
    found = []
    for path in sorted(p for core in ("engine", "sampling", "step") for p in (package / core).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[0] == "nanoinfer" and parts[1] in FEATURE_PACKAGES:
                    found.append(f"{path.name}: {name}")
    assert not found


class Recorder(EngineFeature):
    """Records the hooks the engine calls; awaits each step it encodes, so that the engine must
    complete it before the step samples."""

    def __init__(self):
        self.calls = []

    def check_request(self, intake):
        self.calls.append("check_request")

    def prepare(self, intake):
        self.calls.append("prepare")
        assert len(intake.seqs) == intake.params.n

    def encode(self, batch, step, sample, sampling_seqs):
        self.calls.append("encode")
        return len(batch.seqs)

    def launched(self, launched, state):
        self.calls.append("launched")
        return False

    def complete(self, launched, state):
        self.calls.append("complete")
        assert state == len(launched.batch.seqs)

    def process(self, batch, result):
        self.calls.append("process")

    def exit(self):
        self.calls.append("exit")


class WithRecorder(FeatureComposition):
    def __init__(self, recorder):
        self.recorder = recorder

    def features(self, parts):
        return super().features(parts) + [self.recorder]


def test_registered_hooks_run_in_order_and_leave_results_unchanged(tiny_qwen3):
    options = dict(kvcache_block_size=16, max_model_len=128)
    sp = SamplingParams(temperature=0, max_tokens=4, n=2)
    plain = LLMEngine(tiny_qwen3, FeatureComposition(), **options)
    recorder = Recorder()
    hooked = LLMEngine(tiny_qwen3, WithRecorder(recorder), **options)
    try:
        outs = []
        for engine in (plain, hooked):
            rid = engine.add_request([1, 2, 3, 4, 5], sp, keep_output=True)
            while not engine.is_finished():
                engine.advance()
            outs.append([c.token_ids for c in engine.pop_output(rid).outputs])
        assert outs[0] == outs[1]
    finally:
        plain.exit()
        hooked.exit()
    calls = recorder.calls
    assert calls[:2] == ["check_request", "prepare"] and calls[-1] == "exit"
    steps = calls[2:-1]
    assert steps.count("encode") == steps.count("complete") == steps.count("process") > 0
    for i, call in enumerate(steps):  # a step completes after it is encoded and before it is processed
        if call == "process":
            assert steps[:i].count("complete") >= steps[:i + 1].count("process")


def test_an_engine_without_sampling_options_refuses_what_they_would_serve(tiny_qwen3):
    """A bare composition registers no sampling option: a penalty or a logit bias is refused at intake
    (a ValueError naming the field), never silently ignored; a plain request runs."""
    engine = LLMEngine(tiny_qwen3, kvcache_block_size=16, max_model_len=64, max_num_seqs=2)
    try:
        for params in (SamplingParams(presence_penalty=0.5), SamplingParams(logit_bias={3: 1.0}),
                       SamplingParams(min_tokens=2, max_tokens=4)):
            with pytest.raises(ValueError, match="presence_penalty|logit_bias|min_tokens"):
                engine.add_request([1, 2, 3], params)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        while not engine.is_finished():
            engine.step()
    finally:
        engine.exit()
