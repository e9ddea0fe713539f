"""The composition place: which features an engine runs with, read off the Config. The engine
(engine/) names no feature; it calls the hooks of those registered here (step/feature.py), in
this order, asks the row planner chosen here how long each decoding row is, and the admission rule
chosen here which waiting sequence may run.

    LoRA           lora/feature.py         always (without enable_lora a request's adapter is refused);
                                           on the ranks with enable_lora
    structured     structured/feature.py   always (a request may bring a grammar)
    images         multimodal/feature.py   always (a model without images refuses them); on the
                                           ranks of a vision-language model
    embeddings     pooling/feature.py      runner="pooling", on the ranks too (else embedding
                                           requests are refused)
    prompt logprobs  prompt_logprobs/feature.py  always (a request may ask), on the ranks too
    speculative    speculative/row_planner.py     with speculative_config
    statistics     metrics/stats.py        disable_log_stats=False (logged, LLM.stats, get_metrics)
    sampling       sampling_options/       always: logits processors, bad words and min_tokens, allowed
                                           ids and logit_bias, penalties, grammar masks
    priority       priority/order.py       the scheduler's order: by priority with
                                           scheduling_policy="priority" (else fcfs, refusing a priority)
"""
from nanoinfer.step.feature import Composition, EngineFeature, EngineParts
from nanoinfer.step.row_planner import RowPlanner
from nanoinfer.lora.admission import AdapterAdmission
from nanoinfer.lora.feature import LoRAFeature, LoRARankFeature
from nanoinfer.metrics.stats import StatLogger
from nanoinfer.multimodal.feature import ImageFeature, ImageRankFeature
from nanoinfer.priority.order import order_for
from nanoinfer.pooling.feature import PoolingFeature, PoolingRankFeature, PoolingRefused
from nanoinfer.prompt_logprobs.feature import PromptLogprobsFeature, PromptLogprobsRankFeature
from nanoinfer.sampling_options import default_options
from nanoinfer.sampling_options.grammar import GrammarOption
from nanoinfer.speculative.row_planner import SpeculativeRows
from nanoinfer.speculative.speculator import build_speculator
from nanoinfer.structured.feature import StructuredFeature


class FeatureComposition(Composition):
    def row_planner(self, parts: EngineParts, num_blocks: int) -> RowPlanner:
        config = parts.config
        if config.speculative_config is None:
            return RowPlanner()
        return SpeculativeRows(build_speculator(config, parts.tokenizer, parts.runner, num_blocks,
                                                parts.eos_token_ids))

    def features(self, parts: EngineParts) -> list[EngineFeature]:
        config = parts.config
        pooling = PoolingFeature(config) if config.runner == "pooling" else PoolingRefused(config.runner)
        features = [pooling, LoRAFeature(config),
                    StructuredFeature(config, parts.tokenizer, parts.vocab_size, parts.eos_token_ids, parts.runner,
                                      parts.masks_later),
                    ImageFeature(config, parts.vocab_size), PromptLogprobsFeature(parts.tokenizer)]
        if not config.disable_log_stats:
            features.append(StatLogger())  # logged every few seconds
        return features

    def sampling_options(self) -> list:
        return default_options() + [GrammarOption()]

    def admission(self, config):
        return AdapterAdmission(config.max_loras) if config.enable_lora else None

    def order(self, config):
        return order_for(config)

    def rank_features(self, config) -> list:
        makers = [PromptLogprobsRankFeature]
        if config.enable_lora:
            makers.append(LoRARankFeature)
        if getattr(config.hf_config, "vision_config", None) is not None:
            makers.append(ImageRankFeature)
        if config.runner == "pooling":
            makers.append(PoolingRankFeature)
        return makers
