"""PoolingParams: per-request options of an embedding or classification request."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """dimensions: keep the first N values of the embedding (Matryoshka models), then normalise.
    normalize: L2-normalise the embedding (None: the model's default, usually True)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")

    def to_dict(self) -> dict:
        """Plain data for Request.pooling_params (crosses the engine process boundary)."""
        return {"dimensions": self.dimensions, "normalize": self.normalize}
