"""`--lora-modules` (vLLM's flag): the adapters the server offers, each selected by a request's
`model` field. An entry is NAME=PATH or vLLM's JSON form {"name": ..., "path": ...,
"base_model_name": ...}; adapters get ids 1, 2, ... in the order given. Each is checked against the
model on its first request (a bad one answers 400 naming the tensor)."""
import json

from nanoinfer.lora import LoRARequest


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
