"""Counters a model keeps on its device (e.g. the expert-parallel load per rank): any module with
`read_counters() -> {name: tensor}` contributes, and counters of the same name add up. Read only
when statistics are read: one host copy per name."""
from torch import nn


def model_counters(model: nn.Module) -> dict[str, list[int]]:
    sums = {}
    for module in model.modules():
        reader = getattr(module, "read_counters", None)
        for name, value in (reader() if reader is not None else {}).items():
            sums[name] = value.clone() if name not in sums else sums[name] + value
    return {name: total.tolist() for name, total in sums.items()}
