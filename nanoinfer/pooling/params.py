"""PoolingParams: vLLM's options of one embedding request."""
from dataclasses import dataclass
from numbers import Integral


@dataclass
class PoolingParams:
    """dimensions: keep the first `dimensions` values of the embedding (Matryoshka models), before
    normalising; None keeps them all. normalize: divide by the L2 norm (None: the model's default,
    which is True for every pooling type nanoinfer reads)."""
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.dimensions is not None:
            if not isinstance(self.dimensions, Integral) or isinstance(self.dimensions, bool):
                raise ValueError(f"dimensions must be an int or None, got {type(self.dimensions).__name__}")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
            self.dimensions = int(self.dimensions)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {type(self.normalize).__name__}")
