"""Built-in filters: differential privacy, float16 and top-k compression, variable exclusion."""

from fedlink.runner.filters.compression import Float16Compression, TopKSparsification
from fedlink.runner.filters.exclude import ExcludeVariables
from fedlink.runner.filters.privacy import GaussianPrivacy

__all__ = ["ExcludeVariables", "Float16Compression", "GaussianPrivacy", "TopKSparsification"]
