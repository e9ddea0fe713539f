"""Embeddings' engine hooks (step/feature.py), registered for an engine made with
runner="pooling": at intake a request's PoolingParams are checked against the model and its
sequences get their PoolingState, the scheduler seeing a prompt of one step (intake.py); each
step's message marks the rows whose hidden states the ranks sum instead of sampling (rows.py); the
sums return to the requests before the scheduler finishes them; a request's output is its embedding
(outputs.py). A generating engine registers PoolingRefused, which turns embedding requests away."""
from nanoinfer.step.feature import EngineFeature, Intake, RankFeature
from nanoinfer.pooling.dispatch import POOLED, PoolingDispatch
from nanoinfer.pooling.intake import POOLING_SAMPLING, PoolingIntake, runner_mismatch
from nanoinfer.pooling.outputs import pooling_output
from nanoinfer.pooling.params import PoolingParams
from nanoinfer.pooling.rows import POOLING, pooling_rows, record_pooled


class PoolingFeature(EngineFeature):
    def __init__(self, config):
        self.intake = PoolingIntake(config.model, config.hf_config.hidden_size)

    @property
    def pooling_type(self) -> str:
        return self.intake.pooling_type

    def check_request(self, intake: Intake) -> None:
        intake.extras["pooling_params"] = self.intake.check([intake.params])[0]
        intake.params = POOLING_SAMPLING
        intake.generates = False  # (an embedding's prompt may fill max_model_len)

    def prepare(self, intake: Intake) -> None:
        self.intake.attach(intake.seqs, intake.extras["pooling_params"])

    def encode(self, batch, step, sample, sampling_seqs):
        step.add_part(POOLING, pooling_rows(batch))  # every row pools
        step.prefill = True  # (never a decode step of short rows)

    def process(self, batch, result) -> None:
        if result.outputs and POOLED in result.outputs:  # before the scheduler finishes them: kept while running
            record_pooled(batch, result.outputs[POOLED])

    def request_output(self, request):
        return pooling_output(request)


class PoolingRefused(EngineFeature):
    def __init__(self, runner: str):
        self.runner = runner

    def check_request(self, intake: Intake) -> None:
        if isinstance(intake.params, PoolingParams):
            raise runner_mismatch(self.runner, pooling=True)


class PoolingRankFeature(RankFeature):
    """A rank of an embedding engine: its steps run eager and report their rows' summed hidden
    states instead of tokens (dispatch.py)."""
    captures_graphs = warms_up = False
    sampler_class = PoolingDispatch

    def __init__(self, runner):
        pass
