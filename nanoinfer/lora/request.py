"""LoRARequest: which adapter a request runs under (vLLM's fields and positional order)."""
import os
from dataclasses import dataclass
from numbers import Integral


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: a name for the adapter (the server's model name); lora_int_id: a unique id > 0
    (requests with the same id share the adapter's slot and prefix cache); lora_path: the PEFT
    directory (adapter_config.json + adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError(f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, Integral) or isinstance(self.lora_int_id, bool):
            raise TypeError(f"LoRARequest.lora_int_id must be an int, got {type(self.lora_int_id).__name__}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be > 0, got {self.lora_int_id}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not os.fspath(self.lora_path):
            raise TypeError(f"LoRARequest.lora_path must be a path to a PEFT adapter directory, "
                            f"got {self.lora_path!r}")
        object.__setattr__(self, "lora_int_id", int(self.lora_int_id))
        object.__setattr__(self, "lora_path", os.path.expanduser(os.fspath(self.lora_path)))

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
