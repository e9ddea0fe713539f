"""One rank's adapters: the device slots of every LoRA layer, and a host cache of adapters read
from disk (least recently used out first, max_cpu_loras of them). A step's message lists the
adapters it uses with their slots (slot_table.py); `ensure` loads those whose slot holds another
adapter, before the step's forward. Device copies are queued on the step's stream, so a slot that
the step still in flight reads is overwritten only after it."""
from collections import OrderedDict

import torch
from torch import nn

from nanoinfer.lora.intake import adapter_limits
from nanoinfer.lora.linear import LoRALinearMethod
from nanoinfer.lora.peft_adapter import PeftAdapter, read_peft_adapter


class DeviceAdapters:
    def __init__(self, model: nn.Module, config, device: torch.device):
        self.layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), LoRALinearMethod)]
        self.limits = adapter_limits(config)
        self.dtype, self.device = config.torch_dtype, device
        self.slot_ids = [0] * config.max_loras  # the adapter id each slot holds (0: none)
        self.max_cpu_loras = config.max_cpu_loras
        self.host: OrderedDict[int, PeftAdapter] = OrderedDict()
        self.num_loads = 0  # adapters written into a slot so far (tests, benchmarks)

    def ensure(self, adapters: list[tuple[int, int, str]]):
        """Make each (slot, lora_int_id, path) hold its adapter."""
        for slot, lora_id, path in adapters:
            if self.slot_ids[slot] != lora_id:
                self.slot_ids[slot] = 0  # (until written: a failed load leaves the slot empty)
                self._write(slot, self._host_copy(lora_id, path))
                self.slot_ids[slot] = lora_id

    def _host_copy(self, lora_id: int, path: str) -> PeftAdapter:
        adapter = self.host.get(lora_id)
        if adapter is None:
            adapter = read_peft_adapter(path, self.limits, self.dtype)
            if self.device.type == "cuda":
                for w in adapter.modules.values():
                    w.a, w.b = w.a.pin_memory(), w.b.pin_memory()
            self.host[lora_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lora_id)
        return adapter

    @torch.inference_mode()
    def _write(self, slot: int, adapter: PeftAdapter):
        for layer in self.layers:
            method: LoRALinearMethod = layer.method
            method.clear_slot(layer, slot)
            head = layer.prefix.rpartition(".")[0]
            for j, (ckpt, _) in enumerate(method.shards):
                w = adapter.modules.get(f"{head}.{ckpt}")
                if w is not None:
                    method.write_shard(layer, slot, j, w.a.to(self.device, non_blocking=True),
                                       w.b.to(self.device, non_blocking=True), w.scale)
        self.num_loads += 1
