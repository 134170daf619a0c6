"""Built-in data sources (arrays, .npz, CSV) and partitioning among devices."""

from fedlink.runner.data.arrays import ArrayDataSource
from fedlink.runner.data.device import DeviceData
from fedlink.runner.data.files import CsvDataSource, NpzDataSource
from fedlink.runner.data.partition import PartitionedDataSource, all_partitions, partition_indices

__all__ = [
    "ArrayDataSource",
    "CsvDataSource",
    "DeviceData",
    "NpzDataSource",
    "PartitionedDataSource",
    "all_partitions",
    "partition_indices",
]
