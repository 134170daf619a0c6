"""Experiment tracking: the metric sinks (MLflow, TensorBoard, JSON lines) that jobs' rounds are logged to."""

from fedlink.server.tracking.sinks import (
    GuardedSink,
    JsonlSink,
    MetricPoint,
    MetricSink,
    MlflowSink,
    TensorBoardSink,
    TrackedJob,
    TrackingConfig,
    build_sinks,
)

__all__ = [
    "GuardedSink",
    "JsonlSink",
    "MetricPoint",
    "MetricSink",
    "MlflowSink",
    "TensorBoardSink",
    "TrackedJob",
    "TrackingConfig",
    "build_sinks",
]
