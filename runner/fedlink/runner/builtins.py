"""The component types every job config can use without registering them.

=========================  ==========================================================================
type name                  component
=========================  ==========================================================================
LinearRegressionTrainer    :class:`~fedlink.runner.executors.LinearRegressionTrainer` (executor)
SoftmaxRegressionTrainer   :class:`~fedlink.runner.executors.SoftmaxRegressionTrainer` (executor)
MLPTrainer                 :class:`~fedlink.runner.executors.MLPTrainer` (executor)
GaussianPrivacy            :class:`~fedlink.runner.filters.GaussianPrivacy` (filter)
Float16Compression         :class:`~fedlink.runner.filters.Float16Compression` (filter)
TopKSparsification         :class:`~fedlink.runner.filters.TopKSparsification` (filter)
ExcludeVariables           :class:`~fedlink.runner.filters.ExcludeVariables` (filter)
ArrayDataSource            :class:`~fedlink.runner.data.ArrayDataSource` (data source)
NpzDataSource              :class:`~fedlink.runner.data.NpzDataSource` (data source)
CsvDataSource              :class:`~fedlink.runner.data.CsvDataSource` (data source)
PartitionedDataSource      :class:`~fedlink.runner.data.PartitionedDataSource` (data source)
LossRecorder               :class:`~fedlink.runner.handlers.LossRecorder` (event handler)
=========================  ==========================================================================

An app's :class:`~fedlink.runner.config.ResolverRegistry` overrides any of these by name.
"""

from __future__ import annotations

from fedlink.runner.config import Factory, ResolverRegistry
from fedlink.runner.data import ArrayDataSource, CsvDataSource, NpzDataSource, PartitionedDataSource
from fedlink.runner.executors import LinearRegressionTrainer, MLPTrainer, SoftmaxRegressionTrainer
from fedlink.runner.filters import ExcludeVariables, Float16Compression, GaussianPrivacy, TopKSparsification
from fedlink.runner.handlers import LossRecorder

__all__ = ["BUILTIN_TYPES", "builtin_registry"]

BUILTIN_TYPES: dict[str, Factory] = {
    cls.__name__: cls
    for cls in (
        LinearRegressionTrainer,
        SoftmaxRegressionTrainer,
        MLPTrainer,
        GaussianPrivacy,
        Float16Compression,
        TopKSparsification,
        ExcludeVariables,
        ArrayDataSource,
        NpzDataSource,
        CsvDataSource,
        PartitionedDataSource,
        LossRecorder,
    )
}
"""The built-in component types by name."""


def builtin_registry() -> ResolverRegistry:
    """A fresh registry holding the built-in types (changing it does not affect later calls)."""
    return ResolverRegistry(BUILTIN_TYPES)
