"""Server steps: how a round's aggregate update becomes the next global model.

FedAvg adds the aggregate to the model. The server optimizers of Hsu et al. 2019 (FedAvgM) and Reddi et
al. 2021, "Adaptive Federated Optimization" (FedAdam, FedYogi, FedAdagrad) treat it as a pseudo-gradient
and keep state across rounds (a momentum buffer, first and second moments), computed as Flower 1.42's
strategies of the same names compute them (the formulas are in ``control_service.proto``), with one
difference: a variable no update carried in a round keeps its value and its state (Flower refuses the
round).

Everything is computed a step of elements at a time in float64 from the aggregate's float64 parts, and
rounded once into the new model's dtype: no float64 temporary of the model's size. The state is kept in
the model variable's dtype widened to at least float32 (float32 moments for a float32 model, as
Flower's), and is part of every checkpoint (:class:`OptimizerState`): a coordinator restarted from a
checkpoint continues with exactly the state the uninterrupted run had, so the models are bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedlink.common.errors import InvalidArgument
from fedlink.server.workflows.aggregation import Aggregate, apply_average

Arrays = Mapping[str, NDArray[Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerState:
    """What a server step carries from one round to the next: counters and arrays."""

    #: JSON values (e.g. which variables have a momentum buffer yet).
    values: Mapping[str, Any] = field(default_factory=dict)
    #: Named arrays (``"m/<variable>"``, ``"v/<variable>"``, ...).
    arrays: Mapping[str, NDArray[Any]] = field(default_factory=dict)


class ServerStep(Protocol):
    """Makes the next global model from the current one and the round's aggregate update."""

    def apply(self, model: Arrays, aggregate: Aggregate, *, round_no: int) -> dict[str, NDArray[Any]]:
        """The new model; updates the step's state."""
        ...

    def state(self) -> OptimizerState:
        """The state to checkpoint with the new model."""
        ...

    def restore(self, state: OptimizerState) -> None:
        """Takes the state of a checkpoint back (a resumed run)."""
        ...


class AddAggregate:
    """FedAvg's step: the model plus the aggregate; no state."""

    def apply(self, model: Arrays, aggregate: Aggregate, *, round_no: int) -> dict[str, NDArray[Any]]:
        """``model + aggregate``, rounded to each variable's dtype."""
        return apply_average(model, aggregate, is_diff=True)

    def state(self) -> OptimizerState:
        """Nothing."""
        return OptimizerState()

    def restore(self, state: OptimizerState) -> None:
        """Nothing to restore."""


def _state_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.result_type(dtype, np.float32) if dtype.kind == "f" else np.dtype(np.float64)


class _MomentStep:
    """The shared loop of the stateful steps: per variable, per step of elements, in float64."""

    #: The state arrays this step keeps per variable (prefixes of their names).
    moments: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._arrays: dict[str, NDArray[Any]] = {}

    def apply(self, model: Arrays, aggregate: Aggregate, *, round_no: int) -> dict[str, NDArray[Any]]:
        """The new model; the moments of each covered variable move a step."""
        covered = aggregate.covered()
        scale = self._rate(round_no)
        out: dict[str, NDArray[Any]] = {}
        for name, current in model.items():
            if name not in covered:
                out[name] = current
                continue
            kept = [self._moment(moment, name, current) for moment in self.moments]
            new = np.empty(current.shape, dtype=current.dtype)
            flat_new, flat_current = new.reshape(-1), current.reshape(-1)
            for start, delta in aggregate.steps(name):
                end = start + delta.size
                change = self._step(name, delta, [moment.reshape(-1)[start:end] for moment in kept], scale)
                np.add(change, flat_current[start:end], out=change, dtype=np.float64)
                flat_new[start:end] = change
            out[name] = new
        self._applied(covered)
        return out

    def _moment(self, moment: str, name: str, current: NDArray[Any]) -> NDArray[Any]:
        key = f"{moment}/{name}"
        array = self._arrays.get(key)
        if array is None or array.shape != current.shape:
            array = self._arrays[key] = np.zeros(current.shape, _state_dtype(current.dtype))
        return array

    def _applied(self, covered: frozenset[str]) -> None:
        """Called once a round's step is made."""

    def _rate(self, round_no: int) -> float:
        raise NotImplementedError

    def _step(
        self, name: str, delta: NDArray[np.float64], stored: list[NDArray[Any]], scale: float
    ) -> NDArray[np.float64]:
        """Moves the moments of ``name`` (their parts in ``stored``, written in place) and returns the
        model's change, computed from the moments as stored (rounded): a resumed run, which has only
        those, makes the same change."""
        raise NotImplementedError

    def state(self) -> OptimizerState:
        """The moments, by ``<moment>/<variable>``."""
        return OptimizerState(arrays=dict(self._arrays))

    def restore(self, state: OptimizerState) -> None:
        """Takes checkpointed moments back (copies: the step writes into them)."""
        self._arrays = {key: np.array(array) for key, array in state.arrays.items()}


class MomentumStep(_MomentStep):
    """FedAvgM: ``buffer = delta`` the first time, then ``momentum * buffer + delta``; the model moves
    by ``lr * buffer`` (Flower's FedAvgM, which follows torch.optim.SGD's momentum)."""

    moments = ("momentum",)

    def __init__(self, *, learning_rate: float, momentum: float) -> None:
        super().__init__()
        self._lr = learning_rate
        self._momentum = momentum
        #: Variables whose buffer exists (it starts as the first delta, not as zeros times momentum).
        self._started: set[str] = set()

    def apply(self, model: Arrays, aggregate: Aggregate, *, round_no: int) -> dict[str, NDArray[Any]]:
        """The new model (see the class docstring)."""
        if self._momentum == 0.0:
            return _scaled(model, aggregate, self._lr)
        return super().apply(model, aggregate, round_no=round_no)

    def _applied(self, covered: frozenset[str]) -> None:
        self._started |= covered

    def _rate(self, round_no: int) -> float:
        return self._lr

    def _step(
        self, name: str, delta: NDArray[np.float64], stored: list[NDArray[Any]], scale: float
    ) -> NDArray[np.float64]:
        (buffer,) = stored
        if name in self._started:
            moved = np.multiply(buffer, self._momentum, dtype=np.float64)
            moved += delta
            buffer[...] = moved
        else:
            buffer[...] = delta
        change: NDArray[np.float64] = np.multiply(buffer, scale, dtype=np.float64)
        return change

    def state(self) -> OptimizerState:
        """The buffers and which variables have one."""
        return OptimizerState(values={"started": sorted(self._started)}, arrays=dict(self._arrays))

    def restore(self, state: OptimizerState) -> None:
        """Takes checkpointed buffers back."""
        super().restore(state)
        self._started = set(state.values.get("started", []))


def _scaled(model: Arrays, aggregate: Aggregate, lr: float) -> dict[str, NDArray[Any]]:
    """``model + lr * aggregate`` a step at a time (FedAvgM without momentum)."""
    if lr == 1.0:
        return apply_average(model, aggregate, is_diff=True)
    covered = aggregate.covered()
    out: dict[str, NDArray[Any]] = {}
    for name, current in model.items():
        if name not in covered:
            out[name] = current
            continue
        new = np.empty(current.shape, dtype=current.dtype)
        flat_new, flat_current = new.reshape(-1), current.reshape(-1)
        for start, delta in aggregate.steps(name):
            end = start + delta.size
            change = np.multiply(delta, lr)
            np.add(change, flat_current[start:end], out=change, dtype=np.float64)
            flat_new[start:end] = change
        out[name] = new
    return out


class AdaptiveStep(_MomentStep):
    """FedAdam, FedYogi and FedAdagrad: ``m`` and ``v`` moments, ``model + eta_t * m / (sqrt(v) + tau)``."""

    def __init__(
        self,
        *,
        rule: str,
        learning_rate: float,
        beta_1: float = 0.0,
        beta_2: float = 0.0,
        tau: float,
        bias_correction: bool = False,
    ) -> None:
        super().__init__()
        if rule not in ("adam", "yogi", "adagrad"):
            raise InvalidArgument(f"unknown adaptive rule {rule!r}")
        self._rule = rule
        self._lr = learning_rate
        self._beta_1 = beta_1
        self._beta_2 = beta_2
        self._tau = tau
        self._bias_correction = bias_correction
        # Adagrad's first moment is the delta itself (Flower's FedAdagrad has beta_1 = 0): not kept.
        self.moments = ("v",) if rule == "adagrad" else ("m", "v")

    def _rate(self, round_no: int) -> float:
        if not self._bias_correction:
            return self._lr
        # Flower's FedAdam: the exponent is the server round plus one (Kingma and Ba's would be the
        # number of steps taken).
        t = round_no + 1.0
        return float(self._lr * math.sqrt(1.0 - self._beta_2**t) / (1.0 - self._beta_1**t))

    def _step(
        self, name: str, delta: NDArray[np.float64], stored: list[NDArray[Any]], scale: float
    ) -> NDArray[np.float64]:
        squared = np.square(delta)
        if self._rule == "adagrad":
            (v_stored,) = stored
            v_stored[...] = v_stored + squared
            first: NDArray[Any] = delta
        else:
            m_stored, v_stored = stored
            m = np.multiply(m_stored, self._beta_1, dtype=np.float64)
            m += (1.0 - self._beta_1) * delta
            v = v_stored.astype(np.float64)
            if self._rule == "adam":
                v *= self._beta_2
                v += (1.0 - self._beta_2) * squared
            else:  # yogi: v - (1 - beta_2) * delta^2 * sign(v - delta^2)
                v -= (1.0 - self._beta_2) * squared * np.sign(v - squared)
            m_stored[...] = m
            v_stored[...] = v
            first = m_stored
        denominator = np.sqrt(v_stored, dtype=np.float64)
        denominator += self._tau
        change: NDArray[np.float64] = np.divide(np.multiply(first, scale, dtype=np.float64), denominator)
        return change
