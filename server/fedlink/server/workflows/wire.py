"""The wire form of workflow specs: ``JobSpec.workflow``, a oneof of one message per built-in workflow
plus ``custom`` for an import-path workflow (see ``control_service.proto``). FedBuff, which has no
rounds, has a message of its own (``FedBuffConfig``).

A built-in workflow's oneof field is named as the workflow (``fedavg``, ``fedadam``, ...). FedAvg's
``FedAvgConfig`` holds the rounds every round-based strategy shares; each strategy's message embeds it
as ``rounds`` and adds its own fields, named as its parameters (unset ``optional`` fields mean the
parameter's default). Converting is the only thing done here; the registry checks the values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

from google.protobuf.message import Message

from fedlink.common.errors import InvalidArgument
from fedlink.server.domain import WorkflowSpec
from fedlink.v1 import control_service_pb2 as pb

#: The oneof field of an import-path workflow.
CUSTOM: Final = "custom"
_ROUNDS: Final = "rounds"
_POLICIES: Final = {
    pb.ROUND_FAILURE_POLICY_UNSPECIFIED: "retry",
    pb.ROUND_FAILURE_POLICY_RETRY: "retry",
    pb.ROUND_FAILURE_POLICY_FAIL: "fail",
}
#: FedAvgConfig's plain fields, taken as they are (0 is a value, not "unset").
_ROUND_SCALARS: Final = (
    "num_rounds",
    "devices_per_round",
    "min_results",
    "min_devices",
    "seed",
    "evaluate",
    "max_round_retries",
)

#: The round keys whose default (FedAvgParams') is not the wire's zero: a job file or config that
#: leaves one out means the default, so it is written out (on the wire, 0 is a value).
ROUND_DEFAULTS: Final[Mapping[str, object]] = {"max_round_retries": 2}


def workflow_field_names() -> tuple[str, ...]:
    """The fields of the ``JobSpec.workflow`` oneof, in declaration order."""
    return tuple(f.name for f in pb.JobSpec.DESCRIPTOR.oneofs_by_name["workflow"].fields)


def spec_from_wire(spec: pb.JobSpec) -> WorkflowSpec:
    """The workflow spec a wire job spec names.

    Raises:
        InvalidArgument: no workflow is set, or a value has no meaning (an unknown enum, bad JSON).
    """
    which = spec.WhichOneof("workflow")
    if which is None:
        raise InvalidArgument(f"spec.workflow must be set (one of {', '.join(workflow_field_names())})")
    if which == CUSTOM:
        return _custom_from_wire(spec.custom)
    message = getattr(spec, which)
    if isinstance(message, pb.FedAvgConfig):
        return WorkflowSpec(name=which, config=_rounds_from_wire(message))
    if isinstance(message, pb.FedBuffConfig):
        return WorkflowSpec(name=which, config=_fedbuff_from_wire(message))
    config = _rounds_from_wire(getattr(message, _ROUNDS))
    for field in message.DESCRIPTOR.fields:
        if field.name == _ROUNDS:
            continue
        if not field.has_presence or message.HasField(field.name):
            config[field.name] = getattr(message, field.name)
    return WorkflowSpec(name=which, config=config)


def spec_to_wire(workflow: WorkflowSpec, into: pb.JobSpec) -> None:
    """Sets ``into``'s workflow oneof from a spec (a built-in's config keys, or an import path).

    Raises:
        InvalidArgument: the spec names no workflow the wire API has, or a value does not fit.
    """
    if workflow.is_import_path:
        into.custom.name = workflow.name
        into.custom.config_json = json.dumps(dict(workflow.config), sort_keys=True)
        return
    if workflow.name == CUSTOM or workflow.name not in workflow_field_names():
        raise InvalidArgument(f"workflow {workflow.name!r} has no wire form")
    message = getattr(into, workflow.name)
    config = dict(workflow.config)
    if isinstance(message, pb.FedBuffConfig):
        _fedbuff_to_wire(config, message)
        return
    rounds = message if isinstance(message, pb.FedAvgConfig) else getattr(message, _ROUNDS)
    _rounds_to_wire(config, rounds)
    if message is rounds:
        message.SetInParent()
        return
    for field in message.DESCRIPTOR.fields:
        if field.name != _ROUNDS and field.name in config:
            _set(message, field.name, config[field.name])


# ---- FedAvgConfig: the rounds ----------------------------------------------------------------------


def _rounds_from_wire(message: pb.FedAvgConfig) -> dict[str, Any]:
    config: dict[str, Any] = {name: getattr(message, name) for name in _ROUND_SCALARS}
    if message.fraction:
        config["fraction"] = message.fraction
    if message.HasField("round_timeout"):
        seconds = _seconds(message.round_timeout, "round_timeout")
        if seconds:  # zero means the coordinator's default
            config["round_timeout_s"] = seconds
    if message.HasField("pickup_timeout"):
        seconds = _seconds(message.pickup_timeout, "pickup_timeout")
        if seconds:  # zero means the coordinator's default
            config["pickup_timeout_s"] = seconds
    policy = _POLICIES.get(message.round_failure_policy)
    if policy is None:
        raise InvalidArgument(f"unknown round_failure_policy {message.round_failure_policy}")
    config["round_failure_policy"] = policy
    if message.HasField("keep_checkpoints"):
        config["keep_checkpoints"] = message.keep_checkpoints
    return config


def _rounds_to_wire(config: Mapping[str, Any], message: pb.FedAvgConfig) -> None:
    for name in _ROUND_SCALARS:
        if name in config:
            _set(message, name, config[name])
        elif name in ROUND_DEFAULTS:
            _set(message, name, ROUND_DEFAULTS[name])
    if "fraction" in config:
        message.fraction = float(config["fraction"])
    if "round_timeout_s" in config:
        message.round_timeout.FromTimedelta(timedelta(seconds=float(config["round_timeout_s"])))
    if "pickup_timeout_s" in config:
        message.pickup_timeout.FromTimedelta(timedelta(seconds=float(config["pickup_timeout_s"])))
    if config.get("round_failure_policy") == "fail":
        message.round_failure_policy = pb.ROUND_FAILURE_POLICY_FAIL
    elif "round_failure_policy" in config:
        message.round_failure_policy = pb.ROUND_FAILURE_POLICY_RETRY
    if "keep_checkpoints" in config:
        _set(message, "keep_checkpoints", config["keep_checkpoints"])


def _seconds(duration: Any, name: str) -> float:
    try:
        return float(duration.ToTimedelta().total_seconds())
    except (OverflowError, ValueError):
        raise InvalidArgument(f"{name} is out of range: {duration.seconds}s {duration.nanos}ns") from None


def _set(message: Message, name: str, value: object) -> None:
    try:
        setattr(message, name, value)
    except (TypeError, ValueError):  # out of int32 range, or the wrong type for the field
        raise InvalidArgument(f"{message.DESCRIPTOR.name}.{name} cannot hold {value!r}") from None


# ---- FedBuffConfig: no rounds ---------------------------------------------------------------------

#: FedBuffConfig's ``optional`` fields, taken when set (unset means the parameter's default).
_FEDBUFF_OPTIONAL: Final = (
    "num_updates_for_model",
    "max_model_history",
    "global_lr",
    "staleness_weight",
    "device_selection_size",
    "min_hole_to_fill",
    "device_reuse",
    "keep_checkpoints",
    "eval_frequency",
    "eval_devices",
)
#: FedBuffConfig's durations: (field, config key), zero meaning the default.
_FEDBUFF_DURATIONS: Final = (
    ("device_wait_timeout", "device_wait_timeout_s"),
    ("task_timeout", "task_timeout_s"),
    ("pickup_timeout", "pickup_timeout_s"),
)
_UPDATE_WEIGHTS: Final = {
    pb.UPDATE_WEIGHT_UNSPECIFIED: "num_examples",
    pb.UPDATE_WEIGHT_NUM_EXAMPLES: "num_examples",
    pb.UPDATE_WEIGHT_DEVICE: "device",
}
_SAMPLING: Final = {
    pb.DEVICE_SAMPLING_STRATEGY_UNSPECIFIED: "balanced",
    pb.DEVICE_SAMPLING_STRATEGY_BALANCED: "balanced",
    pb.DEVICE_SAMPLING_STRATEGY_RANDOM: "random",
}


def _fedbuff_from_wire(message: pb.FedBuffConfig) -> dict[str, Any]:
    config: dict[str, Any] = {"max_model_version": message.max_model_version, "seed": message.seed}
    present: Message = message  # fields named by string: HasField of any message
    for name in _FEDBUFF_OPTIONAL:
        if present.HasField(name):
            config[name] = getattr(message, name)
    for field, key in _FEDBUFF_DURATIONS:
        if present.HasField(field):
            seconds = _seconds(getattr(message, field), field)
            if seconds:  # zero means the default
                config[key] = seconds
    weight = _UPDATE_WEIGHTS.get(message.update_weight)
    if weight is None:
        raise InvalidArgument(f"unknown update_weight {message.update_weight}")
    sampling = _SAMPLING.get(message.device_sampling_strategy)
    if sampling is None:
        raise InvalidArgument(f"unknown device_sampling_strategy {message.device_sampling_strategy}")
    config["update_weight"], config["device_sampling_strategy"] = weight, sampling
    return config


def _fedbuff_to_wire(config: Mapping[str, Any], message: pb.FedBuffConfig) -> None:
    message.SetInParent()
    for name in ("max_model_version", "seed", *_FEDBUFF_OPTIONAL):
        if name in config:
            _set(message, name, config[name])
    for field, key in _FEDBUFF_DURATIONS:
        if key in config and float(config[key]):
            getattr(message, field).FromTimedelta(timedelta(seconds=float(config[key])))
    if config.get("update_weight") == "device":
        message.update_weight = pb.UPDATE_WEIGHT_DEVICE
    elif "update_weight" in config:
        message.update_weight = pb.UPDATE_WEIGHT_NUM_EXAMPLES
    if config.get("device_sampling_strategy") == "random":
        message.device_sampling_strategy = pb.DEVICE_SAMPLING_STRATEGY_RANDOM
    elif "device_sampling_strategy" in config:
        message.device_sampling_strategy = pb.DEVICE_SAMPLING_STRATEGY_BALANCED


# ---- custom ----------------------------------------------------------------------------------------


def _custom_from_wire(message: pb.CustomWorkflowConfig) -> WorkflowSpec:
    if ":" not in message.name:
        raise InvalidArgument(f"custom.name must be an import path pkg.module:factory, not {message.name!r}")
    try:
        config = json.loads(message.config_json) if message.config_json else {}
    except ValueError as exc:
        raise InvalidArgument(f"custom.config_json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgument("custom.config_json must be a JSON object")
    return WorkflowSpec(name=message.name, config=config)


__all__ = ["CUSTOM", "spec_from_wire", "spec_to_wire", "workflow_field_names"]
