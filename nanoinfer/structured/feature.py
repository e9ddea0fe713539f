"""Structured outputs' engine hooks (step/feature.py): at intake a request's grammar is looked up,
or compiled in an intake thread (intake.py); a step whose sampling plan leaves its grammar bitmask
to the engine (one rank: `masks_later`) is launched up to its logits, its masks filled once the step
before it is processed, and it samples before the next forward or its collect (step_masks.py)."""
from nanoinfer.step.feature import EngineFeature, Intake
from nanoinfer.structured.intake import GrammarIntake
from nanoinfer.structured.step_masks import AwaitingMasks, StepMasks

GRAMMAR_OPTION = "structured_outputs"  # the sampling option of the grammar masks (sampling_options/grammar.py)


class StructuredFeature(EngineFeature):
    def __init__(self, config, tokenizer, vocab_size: int, eos_token_ids, runner, masks_later: bool):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = eos_token_ids  # a finished grammar allows only tokens that stop
        self.cache_bytes = config.grammar_cache_bytes
        self._grammar = None  # made for the first structured request (xgrammar is optional)
        self.runner = runner
        self.step_masks = StepMasks(vocab_size, config.device == "cuda") if masks_later else None

    def _grammar_intake(self):
        if self._grammar is None:  # (its compiler imports xgrammar, an optional dependency)
            self._grammar = GrammarIntake(self.tokenizer, self.vocab_size, self.stop_token_ids, self.cache_bytes)
        return self._grammar

    def prepare(self, intake: Intake) -> None:
        spec = intake.params.structured_outputs
        if spec is not None:
            grammar = self._grammar_intake().prepare(spec, intake.seqs)  # (a cached grammar: set now)
            if grammar is not None:
                intake.work.append(grammar)

    def encode(self, batch, step, sample, sampling_seqs):
        grammar = sample.plan.payload(GRAMMAR_OPTION)
        if grammar is not None and grammar.bitmask is None:
            return AwaitingMasks([sampling_seqs[i] for i in grammar.rows], sample.plan.eager)
        return None

    def launched(self, launched, masks: AwaitingMasks) -> bool:
        """Fill the masks; a step with user logits processors samples now, so that an error in them
        fails that step."""
        self.step_masks.fill(masks)
        return masks.eager

    def complete(self, launched, masks: AwaitingMasks) -> None:
        self.step_masks.sample(self.runner, launched.handle, masks)
