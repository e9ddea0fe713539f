"""Embedding requests entering the engine (runner="pooling"): their PoolingParams checked against
the model, and each sequence given its PoolingState. An embedding is a one-row request to the
scheduler: a prompt with max_tokens=1, so it is prefilled (chunked, prefix-cached like any other)
and finishes when its prompt is, never entering decode; its blocks are freed then."""
from nanoinfer.pooling.params import PoolingParams
from nanoinfer.pooling.pooling_config import read_pooling_type
from nanoinfer.pooling.state import PoolingState
from nanoinfer.sampling_params import SamplingParams

# what the scheduler sees of an embedding: one step past the prompt, whose token nobody reads
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)


class PoolingIntake:
    def __init__(self, model_dir: str, hidden_size: int):
        self.pooling_type = read_pooling_type(model_dir)
        self.hidden_size = hidden_size

    def check(self, params: list) -> list[PoolingParams]:
        """Each prompt's PoolingParams, checked against the model (SamplingParams or None: a
        generation request, which a pooling engine refuses)."""
        for p in params:
            if p is None or isinstance(p, SamplingParams):
                raise runner_mismatch("pooling", pooling=False)
            if not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
            if p.dimensions is not None and p.dimensions > self.hidden_size:
                raise ValueError(f"dimensions must be at most the model's hidden size {self.hidden_size}, "
                                 f"got {p.dimensions}")
        return params

    def attach(self, seqs, params: PoolingParams):
        for seq in seqs:
            seq.pooling = PoolingState(self.pooling_type, params, seq.num_prompt_tokens)
            seq.computes_whole_prompt = not seq.pooling.uses_prefix_cache  # (mean and CLS read the first positions)


def per_prompt(pooling_params, num_prompts: int) -> list:
    """One PoolingParams for every prompt (None: the defaults), or a list of one per prompt."""
    if not isinstance(pooling_params, (list, tuple)):
        return [PoolingParams() if pooling_params is None else pooling_params] * num_prompts
    if len(pooling_params) != num_prompts:
        raise ValueError(f"got {len(pooling_params)} pooling_params for {num_prompts} prompts; "
                         "pass one PoolingParams or a list of the same length")
    return [PoolingParams() if p is None else p for p in pooling_params]


def runner_mismatch(runner: str, pooling: bool) -> ValueError:
    if pooling:
        return ValueError(f"embed / encode / score need an LLM made with runner='pooling' (or task='embed'); "
                          f"this one has runner={runner!r}")
    return ValueError("this LLM was made with runner='pooling': it embeds (embed / encode / score, "
                      "/v1/embeddings) and does not generate")
