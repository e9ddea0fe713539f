"""`--lora-modules` (vLLM's flag): the adapters the server offers, each selected by a request's
`model` field. An entry is NAME=PATH or vLLM's JSON form {"name": ..., "path": ...,
"base_model_name": ...}; adapters get ids 1, 2, ... in the order given. Each is checked against the
model on its first request (a bad one answers 400 naming the tensor)."""
import json
import os

from nanoinfer.lora import LoRARequest
from nanoinfer.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter_config


def parse_lora_modules(entries: list[str]) -> list[LoRARequest]:
    requests, names = [], set()
    for i, entry in enumerate(entries, start=1):
        base = None
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {entry!r}: a JSON entry needs \"name\" and \"path\" ({e})") from None
        else:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {entry!r}: expected NAME=PATH")
        if name in names:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        names.add(name)
        requests.append(LoRARequest(name, i, path, base))
    return requests


class ServedModels:
    """The names a request's `model` may use: the served model (and its aliases) and the LoRA
    adapters, which runtime updating (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) may add
    and remove. Adapter ids are never reused: the engine keys its slots and prefix cache by id."""

    def __init__(self, base_names: tuple[str, ...], adapters: list[LoRARequest]):
        self.base_names = tuple(base_names)
        self.adapters = {a.lora_name: a for a in adapters}
        self._next_id = max((a.lora_int_id for a in adapters), default=0) + 1

    def __contains__(self, name) -> bool:
        return name in self.base_names or name in self.adapters

    def adapter(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name)

    def load(self, name: str, path: str) -> LoRARequest:
        """Offer the adapter at `path` as `name`: its directory and config are checked now
        (check_adapter_files), its tensors against the model on its first request."""
        self.check_name(name)
        check_adapter_files(path)
        return self.add(name, path)

    def check_name(self, name: str):
        if not name:
            raise ValueError("lora_name must be non-empty")
        if name in self:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")

    def add(self, name: str, path: str) -> LoRARequest:
        """`name` for the adapter at `path`, whose files check_adapter_files has checked."""
        self.check_name(name)
        lora = self.adapters[name] = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return lora

    def unload(self, name: str):
        if name not in self.adapters:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]  # (requests already queued under it finish under it)


def check_adapter_files(path: str):
    """The adapter directory holds a readable config and the weights file (file reads: the server
    calls this in a worker thread)."""
    if not path:
        raise ValueError("lora_path must be non-empty")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):  # one answer: no probing of what exists where
        raise ValueError(f"LoRA adapter {path!r} is not a directory holding an {CONFIG_FILE}")
    read_adapter_config(path)
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
