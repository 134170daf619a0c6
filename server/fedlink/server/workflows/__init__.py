"""Workflows drive runs: they create tasks, collect results, aggregate and checkpoint."""
