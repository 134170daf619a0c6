"""Simulation: a job on thousands of virtual devices, with the real coordinator core and Runner code.

``run_simulation(job, num_devices, ...)`` returns a :class:`SimulationResult`; ``fedlink simulate
job.toml --devices N`` does the same from the command line.
"""

from fedlink.server.tracking import TrackingConfig
from fedlink.simulation.api import run_simulation, run_simulation_async
from fedlink.simulation.backends import BACKENDS, ExecutorPool, LocalConfig, LocalPool
from fedlink.simulation.heterogeneity import DeviceRound, Heterogeneity
from fedlink.simulation.job import SimulationJob
from fedlink.simulation.progress import MetricsFile, ProgressLine, ProgressSink, TrackingProgress
from fedlink.simulation.ray_backend import RayConfig
from fedlink.simulation.result import Failure, RoundRecord, SimulationError, SimulationResult
from fedlink.simulation.transport import InProcessTransport

__all__ = [
    "BACKENDS",
    "DeviceRound",
    "ExecutorPool",
    "Failure",
    "Heterogeneity",
    "InProcessTransport",
    "LocalConfig",
    "LocalPool",
    "MetricsFile",
    "ProgressLine",
    "ProgressSink",
    "RayConfig",
    "RoundRecord",
    "SimulationError",
    "SimulationJob",
    "SimulationResult",
    "TrackingConfig",
    "TrackingProgress",
    "run_simulation",
    "run_simulation_async",
]
