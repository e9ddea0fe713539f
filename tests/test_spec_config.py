"""speculative_config: vLLM's dict (or the server flag's JSON), every field checked and named."""
import json

import pytest

from nanoinfer import LLM
from nanoinfer.serve.cli import build_parser
from nanoinfer.speculative.config import SpeculativeConfig


def test_ngram_and_draft_model_forms():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 2)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (4, 4)  # one given: the other equals it
    c = SpeculativeConfig.parse(json.dumps({"model": "/some/draft", "num_speculative_tokens": 3}))
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, error, field", [
    ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, TypeError, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "method"),
    ({"num_speculative_tokens": 2}, ValueError, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, ValueError, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "model"),
    ({"model": 3, "num_speculative_tokens": 2}, TypeError, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, ValueError, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"}, TypeError, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}, ValueError,
     "prompt_lookup_min"),
    ({"model": "/x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, ValueError, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, ValueError, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_below_acceptance": 1.5}, ValueError,
     "disable_below_acceptance"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_tokens": 2}, ValueError, "speculative_tokens"),
    ("{not json", ValueError, "JSON"),
    ([1, 2], TypeError, "dict"),
])
def test_bad_fields_are_named(value, error, field):
    with pytest.raises(error, match=field):
        SpeculativeConfig.parse(value)


def test_llm_refuses_a_draft_with_another_vocabulary(tiny_qwen3, make_checkpoint):
    other = make_checkpoint(vocab_size=400)
    with pytest.raises(ValueError, match="vocab"):
        LLM(tiny_qwen3, speculative_config={"model": other, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_qwen3, speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    with pytest.raises(ValueError, match="pooling"):
        LLM(tiny_qwen3, runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_server_flag_takes_json(tiny_qwen3):
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = build_parser().parse_args(["serve", tiny_qwen3, "--speculative-config", text])
    from nanoinfer.config import Config
    config = Config.from_options(tiny_qwen3, speculative_config=args.speculative_config)
    assert config.speculative_config == SpeculativeConfig("ngram", 2)


def test_server_metrics_export_the_counters():
    from nanoinfer.process.messages import EngineStats
    from nanoinfer.serve.metrics import ServerMetrics
    m = ServerMetrics("m")
    m.engine_stats(EngineStats(spec=(2, 6, 4)))
    m.engine_stats(EngineStats(spec=(3, 9, 7)))
    text = m.render().decode()
    assert 'nanoinfer:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'nanoinfer:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0' in text


def test_a_bad_draft_path_names_the_field(tiny_qwen3, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]"):
        LLM(tiny_qwen3, speculative_config={"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2})
