"""The engine's check of a request's adapter, at intake (before anything is queued): LoRA must be
enabled, the adapter must read and match the base model (peft_adapter.py), and one id must always
name the same adapter directory. An adapter is read once per id here; the ranks read it again into
their own host caches when a step first needs it (device_adapters.py), so a known adapter's files
are looked at (stat) on each request: files removed or changed since they were read are read and
checked again here, since a read that fails inside a step fails the whole engine."""
import os

from nanoinfer.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterLimits, read_peft_adapter
from nanoinfer.lora.request import LoRARequest
from nanoinfer.lora.targets import target_shapes


def adapter_limits(config) -> AdapterLimits:
    hf = config.hf_config
    return AdapterLimits(target_shapes(hf), hf.num_hidden_layers, config.max_lora_rank)


class LoRAIntake:
    def __init__(self, config):
        self.enabled = config.enable_lora
        self.limits = adapter_limits(config) if self.enabled else None
        self.known: dict[int, LoRARequest] = {}  # lora_int_id -> the request that first named it
        self._stamps: dict[int, tuple | None] = {}  # lora_int_id -> its files' stamp when last read

    def check(self, lora_request) -> LoRARequest | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if not self.enabled:
            raise ValueError("lora_request given but LoRA is not enabled: create the LLM with enable_lora=True")
        seen = self.known.get(lora_request.lora_int_id)
        if seen is not None:
            if seen.lora_path != lora_request.lora_path:
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} already names adapter {seen.lora_path!r}, "
                                 f"not {lora_request.lora_path!r}: give each adapter its own id")
            if _stamp(seen.lora_path) == self._stamps[lora_request.lora_int_id]:
                return lora_request
        stamp = _stamp(lora_request.lora_path)
        read_peft_adapter(lora_request.lora_path, self.limits)  # raises ValueError naming what is wrong
        self.known[lora_request.lora_int_id] = lora_request
        self._stamps[lora_request.lora_int_id] = stamp
        return lora_request


def _stamp(path: str) -> tuple | None:
    """The adapter files' (mtime, size, inode), None if one is missing."""
    try:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino)
                     for st in (os.stat(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)))
    except (OSError, ValueError):
        return None
