"""Differential privacy for model updates: norm clipping plus Gaussian noise."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO, DataKind, MetaKey, MetaValue
from fedlink.common.errors import InvalidArgument
from fedlink.runner.context import Context, ContextKey, Signal

__all__ = ["GaussianPrivacy"]


class GaussianPrivacy:
    """The Gaussian mechanism on a ``WEIGHT_DIFF`` (DP-FedAvg style, applied on the device).

    What it does to the data, in order:

    1. computes the update's global L2 norm ``‖u‖`` over **all** variables together;
    2. scales every variable by ``min(1, clip_norm / ‖u‖)``, so the clipped norm is at most
       ``clip_norm`` (exactly ``clip_norm`` when the update was larger);
    3. adds independent Gaussian noise with standard deviation ``noise_multiplier * clip_norm`` to
       every element (computed in float64, then cast back to the variable's dtype).

    It records in meta ``dp_clip_norm``, ``dp_noise_multiplier``, ``dp_noise_std`` and
    ``dp_update_norm`` (the norm before clipping; it is itself not private: drop it with a later filter
    if that matters). Encodings are kept. DXOs of other kinds pass through untouched, except
    ``WEIGHTS``, which is refused: clipping a whole model is not a meaningful privacy mechanism.

    Noise is drawn from a generator seeded with ``(seed, partition id, meta model_version)`` when
    ``seed`` is given — reproducible, for tests and simulations only, because predictable noise gives
    no privacy — and from operating-system entropy when it is not (the default). The privacy budget
    (ε, δ) over rounds depends on the sampling rate and round count and is for the operator to account.
    """

    def __init__(self, clip_norm: float, noise_multiplier: float = 1.0, seed: int | None = None) -> None:
        """Configure the mechanism.

        Raises:
            InvalidArgument: ``clip_norm`` is not finite and > 0, ``noise_multiplier`` not finite and
                >= 0, or ``seed`` not an integer >= 0.
        """
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float) or not clip_norm > 0:
            raise InvalidArgument(f"clip_norm must be a number > 0, got {clip_norm!r}")
        if (
            isinstance(noise_multiplier, bool)
            or not isinstance(noise_multiplier, int | float)
            or not noise_multiplier >= 0
        ):
            raise InvalidArgument(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}")
        if not (math.isfinite(clip_norm) and math.isfinite(noise_multiplier)):
            raise InvalidArgument("clip_norm and noise_multiplier must be finite")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidArgument(f"seed must be an integer >= 0 or null, got {seed!r}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.seed = seed

    @property
    def noise_std(self) -> float:
        """The standard deviation of the noise added to every element."""
        return self.noise_multiplier * self.clip_norm

    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Clip and noise a ``WEIGHT_DIFF`` (see the class doc); pass other kinds through."""
        abort_signal.check()
        if dxo.kind == DataKind.WEIGHTS:
            raise InvalidArgument(
                "GaussianPrivacy applies to a WEIGHT_DIFF (an update), not to WEIGHTS; "
                "make the executor send a diff"
            )
        if dxo.kind != DataKind.WEIGHT_DIFF:
            return dxo
        for name, value in dxo.data.items():
            if value.dtype.kind != "f":
                raise InvalidArgument(f"GaussianPrivacy: variable {name!r} is {value.dtype}, not float")
        norm = math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in dxo.data.values()))
        scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        rng = np.random.default_rng(self._seed_sequence(dxo, ctx))
        std = self.noise_std
        data: dict[str, npt.NDArray[Any]] = {}
        for name in sorted(dxo.data):  # a fixed order so a seeded run draws the same noise per name
            value = dxo.data[name]
            noisy = value.astype(np.float64) * scale
            if std > 0:
                noisy += rng.normal(0.0, std, size=value.shape)
            data[name] = noisy.astype(value.dtype)
        meta: dict[str, MetaValue] = {
            **dxo.meta,
            "dp_clip_norm": self.clip_norm,
            "dp_noise_multiplier": self.noise_multiplier,
            "dp_noise_std": std,
            "dp_update_norm": norm,
        }
        return DXO(kind=dxo.kind, data=data, meta=meta, encodings=dict(dxo.encodings))

    def _seed_sequence(self, dxo: DXO, ctx: Context) -> list[int] | None:
        if self.seed is None:
            return None
        partition = ctx.get(ContextKey.PARTITION_ID, 0)
        version = dxo.get_meta_prop(MetaKey.MODEL_VERSION, 0)
        return [self.seed, *(v if isinstance(v, int) and v >= 0 else 0 for v in (partition, version))]
