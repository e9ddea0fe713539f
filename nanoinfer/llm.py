"""User conveniences over the engine loop."""
from time import perf_counter

from tqdm.auto import tqdm

from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.sampling_params import SamplingParams


class LLM(LLMEngine):
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """prompts: a str, a list of str, or a list of token-id lists. sampling_params: one
        SamplingParams for all prompts, or a list with one per prompt. Returns one dict per
        prompt, in prompt order, with "text" and "token_ids" (the completion) and "finish_reason"."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one SamplingParams or a list of the same length")
        else:
            sampling_params = [sampling_params] * len(prompts)
        # Validate every request before queueing any: a bad one adds none of them.
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        order = {self.add_sequence(seq): i for i, seq in enumerate(seqs)}
        results: list[dict | None] = [None] * len(seqs)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while any(r is None for r in results) and not self.is_finished():
                t = perf_counter()
                outputs, num_tokens = self.step()
                dt = max(perf_counter() - t, 1e-9)
                if num_tokens > 0:
                    prefill_tps = num_tokens / dt
                else:
                    decode_tps = -num_tokens / dt
                bar.set_postfix(prefill=f"{int(prefill_tps)}tok/s", decode=f"{int(decode_tps)}tok/s")
                for request_id, token_ids in outputs:
                    if request_id in order:
                        seq = seqs[order[request_id]]
                        results[order[request_id]] = {"text": self.decode(token_ids), "token_ids": token_ids,
                                                      "finish_reason": seq.finish_reason}
                        bar.update(1)
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                self.abort_request(seq.seq_id)
            raise
        finally:
            bar.close()
        return results
