"""LLM.embed / encode / score (vLLM's offline pooling API), for an LLM made with runner="pooling"."""
import torch

from nanoinfer.pooling.intake import per_prompt
from nanoinfer.pooling.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput,
                                       ScoringRequestOutput)


class PoolingAPI:
    """Mixed into LLM: uses its add_requests / advance / pop_output and prompt normalisation."""

    def encode(self, prompts, pooling_params=None, use_tqdm=True, priority=None,
               lora_request=None) -> list[PoolingRequestOutput]:
        """prompts as generate() takes them; pooling_params: one PoolingParams for all (None: the
        defaults) or one per prompt; lora_request as generate() takes it (enable_lora=True). One
        PoolingRequestOutput per prompt, in order, `outputs.data` its pooled vector (a float32 tensor)."""
        return self._pool(prompts, pooling_params, use_tqdm, priority, lora_request)

    def embed(self, prompts, pooling_params=None, use_tqdm=True, priority=None,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """encode(), each result as `outputs.embedding`: a list of floats."""
        return self._pool(prompts, pooling_params, use_tqdm, priority, lora_request, EmbeddingRequestOutput.of)

    def _pool(self, prompts, pooling_params, use_tqdm, priority, lora_request, convert=None) -> list:
        """encode()'s run; `convert` is applied to each output as its request finishes (while
        later steps run on the device, rather than to all of them at the end)."""
        prompts, _ = self._normalize(prompts, None)
        loras = self._lora_requests(lora_request, len(prompts))
        with self.driving():  # before queuing, as generate()
            rids = self.add_requests(prompts, per_prompt(pooling_params, len(prompts)), keep_output=True,
                                     priority=priority, lora_requests=loras)
            return self._run_to_completion(rids, use_tqdm, convert)  # (LLM's)

    def score(self, text_1, text_2, pooling_params=None, use_tqdm=True) -> list[ScoringRequestOutput]:
        """The cosine similarity of text_1's and text_2's embeddings: one text against one, one
        against each of a list, or two lists of the same length pairwise (vLLM's rule)."""
        firsts, seconds = _texts(text_1), _texts(text_2)
        if not firsts or not seconds:
            raise ValueError("score needs at least one text on each side")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
                             "lists of the same length")
        outs = self.encode(firsts + seconds, pooling_params, use_tqdm)
        a, b = outs[:len(firsts)], outs[len(firsts):]
        results = []
        for x, y in zip(a, b):
            cos = torch.nn.functional.cosine_similarity(x.outputs.data, y.outputs.data, dim=0).item()
            results.append(ScoringRequestOutput(x.request_id, x.prompt_token_ids + y.prompt_token_ids,
                                                ScoringOutput(cos)))
        return results


def _texts(x) -> list:
    """One prompt (a str, token ids or a prompt dict) as a list of one; a list of prompts as is."""
    one = not isinstance(x, (list, tuple)) or (len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in x))
    return [x] if one else list(x)
