"""User conveniences over the engine loop: generate, chat (vLLM's offline `LLM` API); stream, embed /
encode / score and the statistics come from mixins (stream.py, pooling/api.py, metrics/api.py)."""
from contextlib import suppress
from numbers import Integral

from tqdm.auto import tqdm

from nanoinfer.chat import render_chat
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.features import FeatureComposition
from nanoinfer.metrics.api import MetricsAPI
from nanoinfer.multimodal.media import MediaLoader
from nanoinfer.outputs import RequestOutput
from nanoinfer.pooling.api import PoolingAPI
from nanoinfer.stream import StreamAPI


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and \
        all(isinstance(t, Integral) and not isinstance(t, bool) for t in x)


def _per_prompt(value, num_prompts: int, name: str, kind: str) -> list:
    """One `value` for every prompt, or a list of one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"got {len(value)} {name} for {num_prompts} prompts; "
                         f"pass one {kind} or a list of the same length")
    return list(value)


class LLM(LLMEngine, StreamAPI, PoolingAPI, MetricsAPI):
    # data_parallel_size=N > 1: generate() and chat() over N engine processes, run by the backend
    # nanoinfer/__init__.py registers here (data_parallel/llm.py); no engine of its own then
    data_parallel_backend = None
    _replicas = None

    def __init__(self, model: str, data_parallel_size: int = 1, **options):
        if data_parallel_size != 1 and self.data_parallel_backend is not None:
            size = self.data_parallel_backend.check_size(data_parallel_size)
            if size > 1:
                self._replicas = self.data_parallel_backend(model, size, **options)
                self.config, self.tokenizer = self._replicas.config, self._replicas.tokenizer
                return
        elif data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 needs nanoinfer.data_parallel (import nanoinfer)")
        super().__init__(model, FeatureComposition(), **options)  # the features, as the config asks

    @property
    def data_parallel_size(self) -> int:
        return self._replicas.data_parallel_size if self._replicas is not None else 1

    def __getattr__(self, name: str):
        """Reached only for attributes never set: with data_parallel_size > 1, the one engine's."""
        if self.__dict__.get("_replicas") is None or name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(
            f"this LLM runs {self._replicas.data_parallel_size} engine processes (data_parallel_size > 1): it offers "
            "generate(), chat(), get_tokenizer() and exit(); stream(), embeddings and the step-by-step API "
            f"need data_parallel_size=1 (asked for: {name})")

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None,
                 priority=None) -> list[RequestOutput]:
        """prompts: a str, a list of token ids, a {"prompt": str} / {"prompt_token_ids": [...]} dict,
        or a list of those. sampling_params (None: defaults) and lora_request (needs enable_lora=True):
        one for every prompt or a list of one per prompt; priority: one int per prompt
        (scheduling_policy="priority": the lower runs first); use_tqdm: a progress bar, or a
        tqdm-like factory. Every request is validated before any is queued. Returns one
        RequestOutput per prompt, in order (`out["text"]`, `out["token_ids"]`: its first completion's,
        as nano-vllm). Requests queued by hand with add_request() progress too; step() reports them."""
        prompts, params = self._normalize(prompts, sampling_params)
        loras = self._lora_requests(lora_request, len(prompts))
        if self._replicas is not None:
            return self._replicas.generate(prompts, params, use_tqdm, loras, priority)
        with self.driving():  # before queuing: another thread driving is an error with nothing queued
            request_ids = self.add_requests(prompts, params, keep_output=True, lora_requests=loras,
                                            priority=priority)
            return self._run_to_completion(request_ids, use_tqdm)

    def chat(self, messages, sampling_params=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             use_tqdm=True, tools: list[dict] | None = None,
             continue_final_message: bool = False, lora_request=None, priority=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts, content a str or a list
        of OpenAI content parts: text, image_url, image_pil) or a list of them, each rendered with
        the tokenizer's chat template (or `chat_template`) and generated as by generate. Image URLs
        follow the allowed_local_media_path / allowed_media_domains rules (multimodal/media.py)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) "
                            "or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        media = MediaLoader(self.config.allowed_local_media_path, self.config.allowed_media_domains)
        prompts = [render_chat(self.tokenizer, conv, chat_template, add_generation_prompt, chat_template_kwargs,
                               tools, continue_final_message, media=media) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority)

    def get_tokenizer(self):
        return self.tokenizer

    def exit(self):
        """Release the engine (every engine process, with data_parallel_size > 1)."""
        if self._replicas is not None:
            self._replicas.exit()
        else:
            super().exit()

    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids, a dict, or a list of those, "
                            f"got {type(prompts).__name__}")
        return list(prompts), _per_prompt(sampling_params, len(prompts), "sampling_params", "SamplingParams")

    @staticmethod
    def _lora_requests(lora_request, num_prompts: int) -> list | None:
        """One adapter (or None) per prompt; each is checked at intake."""
        if lora_request is None:
            return None
        return _per_prompt(lora_request, num_prompts, "lora_request entries", "LoRARequest")

    def _run_to_completion(self, request_ids: list[int], use_tqdm, convert=None) -> list:
        """Each request's output, in order, once all have finished, passed through `convert` if given."""
        position = {rid: i for i, rid in enumerate(request_ids)}  # the requests not finished yet
        results: list = [None] * len(request_ids)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                       disable=not use_tqdm, postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        in_tokens = out_tokens = 0
        try:
            while position:
                if self.is_finished():
                    raise RuntimeError("the engine has no work left but requests are unfinished")
                finished, _ = self.advance()
                for rid in finished:
                    if rid not in position:
                        continue  # another caller's request
                    out = self.pop_output(rid)
                    results[position.pop(rid)] = convert(out) if convert is not None else out
                    in_tokens += len(out.prompt_token_ids)
                    if isinstance(out, RequestOutput):  # (an embedding's output has no tokens)
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if use_tqdm:
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                       f"output: {out_tokens / elapsed:.2f} toks/s")
                        bar.update(1)
        except BaseException:
            for rid in position:  # leave the engine clean for the next call (aborts what still runs)
                with suppress(KeyError):
                    self.pop_output(rid)
            raise
        finally:
            bar.close()
        return results
