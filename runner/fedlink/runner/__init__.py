"""The device side of fedlink: NVFlare-style executors, filters, data sources and job-config processing."""

from fedlink.runner.config import (
    ComponentNotAllowed,
    ComponentResolver,
    JobConfig,
    JobConfigError,
    NoExecutorForTask,
    ResolverRegistry,
    process_job_data,
)
from fedlink.runner.context import Aborted, Context, ContextKey, EventType, Signal
from fedlink.runner.spec import ArrayDataset, Batch, Dataset, DataSource, EventHandler, Executor, Filter

__all__ = [
    "Aborted",
    "ArrayDataset",
    "Batch",
    "ComponentNotAllowed",
    "ComponentResolver",
    "Context",
    "ContextKey",
    "DataSource",
    "Dataset",
    "EventHandler",
    "EventType",
    "Executor",
    "Filter",
    "JobConfig",
    "JobConfigError",
    "NoExecutorForTask",
    "ResolverRegistry",
    "Signal",
    "process_job_data",
]
