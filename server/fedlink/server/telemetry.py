"""Prometheus metrics of one coordinator: RPC counts and latencies, and domain gauges.

Each :class:`Telemetry` owns its own ``CollectorRegistry`` rather than prometheus_client's global one, so
tests and several coordinators in one process never collide. The gRPC layer calls
:meth:`Telemetry.observe` after every call (it is the ``RpcObserver``); the coordinator sets the domain
gauges as its state changes; :meth:`Telemetry.start_http_server` serves ``/metrics`` (404 at any other
path).

Label values are bounded sets (service, method, status code, state, outcome) except ``job_id``, whose
series are removed with :meth:`Telemetry.forget_job` when a job ends, so cardinality stays small.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import ThreadingWSGIServer

from fedlink.common.version import __version__
from fedlink.server.domain.states import DeviceState, JobState
from fedlink.server.settings import split_address

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

#: Latency buckets from 0.1 ms (a cached lookup) to 60 s (beyond the longest GetTask long poll).
RPC_DURATION_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
)

#: The outcomes counted by ``fedlink_results_total``.
RESULT_OUTCOMES: Final = ("accepted", "stale", "failed", "rejected")


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint (a daemon thread); stop it with :meth:`stop`."""

    server: WSGIServer
    thread: threading.Thread
    host: str
    port: int
    """The bound port (the real one when port 0 was asked for)."""

    @property
    def url(self) -> str:
        """The URL of the metrics page."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stops serving and waits for the thread to end."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Telemetry:
    """The metrics of one coordinator, on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Creates the metrics.

        Args:
            registry: Where to register them; default: a new registry used by nothing else.
        """
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._rpc_requests = Counter(
            "fedlink_rpc_requests",
            "Finished RPCs by service, method and gRPC status code.",
            ("service", "method", "code"),
            registry=r,
        )
        self._rpc_duration = Histogram(
            "fedlink_rpc_duration_seconds",
            "Time from receiving an RPC to its status, long polls included.",
            ("service", "method"),
            buckets=RPC_DURATION_BUCKETS,
            registry=r,
        )
        self._rpc_series: dict[tuple[str, str, grpc.StatusCode], tuple[Counter, Histogram]] = {}
        self._devices = Gauge("fedlink_devices", "Enrolled devices by state.", ("state",), registry=r)
        self._jobs = Gauge("fedlink_jobs", "Jobs by state.", ("state",), registry=r)
        self._round = Gauge(
            "fedlink_round", "The current round of each running job.", ("job_id",), registry=r
        )
        self._round_results = Gauge(
            "fedlink_round_results",
            "Results accepted so far for the open round of each running job.",
            ("job_id",),
            registry=r,
        )
        # FedBuff's jobs have model versions instead of rounds. The selection's fill and its size are two
        # gauges, not a ratio: a ratio hides whether 50 % is 1 of 2 devices or 500 of 1,000, and
        # fedlink_selection_filled / fedlink_selection_size is one PromQL division away.
        self._model_version = Gauge(
            "fedlink_model_version",
            "The latest global model version of each running FedBuff job (0: the initial model).",
            ("job_id",),
            registry=r,
        )
        self._buffered_updates = Gauge(
            "fedlink_buffered_updates",
            "Updates of each running FedBuff job accepted and not yet aggregated into a model version.",
            ("job_id",),
            registry=r,
        )
        self._selection_filled = Gauge(
            "fedlink_selection_filled",
            "Devices holding a task of each running FedBuff job's selection (not yet reported or lost).",
            ("job_id",),
            registry=r,
        )
        self._selection_size = Gauge(
            "fedlink_selection_size",
            "The devices each running FedBuff job's selection holds when full (device_selection_size).",
            ("job_id",),
            registry=r,
        )
        self._results = Counter(
            "fedlink_results",
            "Results reported by devices: accepted (into the aggregate), stale (recorded, not aggregated), "
            "failed (the device's executor failed), rejected (invalid, refused with an error).",
            ("outcome",),
            registry=r,
        )
        info = prometheus_client.Info("fedlink_build", "The running fedlink version.", registry=r)
        info.info({"version": __version__})
        # Zero series exist from the start, so rate() and absent() behave before the first event.
        self.set_devices({})
        self.set_jobs({})
        for outcome in RESULT_OUTCOMES:
            self._results.labels(outcome=outcome)

    def observe(self, service: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Records one finished RPC (the ``RpcObserver`` the gRPC layer calls)."""
        series = self._rpc_series.get((service, method, code))
        if series is None:
            # Looking a labelled series up costs microseconds per call: every RPC does it, so the
            # (bounded: service x method x code) series are looked up once and kept.
            series = (
                self._rpc_requests.labels(service=service, method=method, code=code.name),
                self._rpc_duration.labels(service=service, method=method),
            )
            self._rpc_series[(service, method, code)] = series
        series[0].inc()
        series[1].observe(seconds)

    def set_devices(self, counts: Mapping[DeviceState, int] | Mapping[str, int]) -> None:
        """Sets the number of devices in each state; states left out are set to 0.

        Raises:
            ValueError: a key is not a device state (a programming error).
        """
        _set_by_state(self._devices, counts.items(), DeviceState)

    def set_jobs(self, counts: Mapping[JobState, int] | Mapping[str, int]) -> None:
        """Sets the number of jobs in each state; states left out are set to 0.

        Raises:
            ValueError: a key is not a job state (a programming error).
        """
        _set_by_state(self._jobs, counts.items(), JobState)

    def set_round(self, job_id: str, round_number: int, results: int = 0) -> None:
        """Sets a job's current round and how many results its open round has so far."""
        self._round.labels(job_id=job_id).set(round_number)
        self._round_results.labels(job_id=job_id).set(results)

    def set_round_results(self, job_id: str, results: int) -> None:
        """Sets how many results the open round of a job has so far."""
        self._round_results.labels(job_id=job_id).set(results)

    def set_model_version(
        self, job_id: str, version: int, *, buffered: int, selection_filled: int, selection_size: int
    ) -> None:
        """Sets a FedBuff job's model version, buffered updates and its selection's fill and size."""
        self._model_version.labels(job_id=job_id).set(version)
        self._buffered_updates.labels(job_id=job_id).set(buffered)
        self._selection_filled.labels(job_id=job_id).set(selection_filled)
        self._selection_size.labels(job_id=job_id).set(selection_size)

    def forget_job(self, job_id: str) -> None:
        """Removes a finished or deleted job's series."""
        for gauge in (
            self._round,
            self._round_results,
            self._model_version,
            self._buffered_updates,
            self._selection_filled,
            self._selection_size,
        ):
            with contextlib.suppress(KeyError):  # the job never had a series of this gauge
                gauge.remove(job_id)

    def count_result(self, outcome: str) -> None:
        """Counts one reported result.

        Raises:
            ValueError: ``outcome`` is not one of :data:`RESULT_OUTCOMES` (a programming error).
        """
        if outcome not in RESULT_OUTCOMES:
            raise ValueError(f"unknown result outcome {outcome!r}; expected one of {RESULT_OUTCOMES}")
        self._results.labels(outcome=outcome).inc()

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format (what ``/metrics`` serves)."""
        return prometheus_client.generate_latest(self.registry)

    def start_http_server(self, address: str) -> MetricsServer:
        """Serves ``/metrics`` for this registry on ``host:port`` in a daemon thread.

        Args:
            address: ``host:port``; port 0 picks a free port, reported in the result.

        Raises:
            InvalidArgument: the address is not ``host:port``.
            OSError: the address cannot be bound.
        """
        host, port = split_address(address, what="metrics_address")
        # Not prometheus_client.start_http_server, which serves the metrics at every path: a typo'd
        # scrape path, or a probe of "/", gets 404 here rather than a page that looks right.
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][
            0
        ]
        server_type = type("MetricsHTTPServer", (ThreadingWSGIServer,), {"address_family": family})
        app = _only_metrics(prometheus_client.make_wsgi_app(self.registry))
        server: WSGIServer = make_server(host, port, app, server_type, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="fedlink-metrics", daemon=True)
        thread.start()
        return MetricsServer(server=server, thread=thread, host=host, port=server.server_port)


#: The one path the metrics endpoint serves.
METRICS_PATH: Final = "/metrics"


def _only_metrics(app: WSGIApplication) -> WSGIApplication:
    """``app`` at :data:`METRICS_PATH`; 404 Not Found at every other path."""

    def serve(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == METRICS_PATH:
            return app(environ, start_response)
        body = f"not found: the coordinator's metrics are at {METRICS_PATH}\n".encode()
        start_response(
            "404 Not Found",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return serve


class _QuietHandler(WSGIRequestHandler):
    """No access log line on stderr per scrape (the coordinator's own log says what matters)."""

    def log_message(self, format: str, *args: object) -> None:
        """Drops the line."""


def _set_by_state(gauge: Gauge, counts: Iterable[tuple[str, int]], states: Iterable[str]) -> None:
    known = {str(state) for state in states}
    given = {str(state): count for state, count in counts}
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"unknown states {sorted(unknown)}; expected some of {sorted(known)}")
    for state in sorted(known):
        gauge.labels(state=state).set(given.get(state, 0))


__all__ = ["METRICS_PATH", "RESULT_OUTCOMES", "RPC_DURATION_BUCKETS", "MetricsServer", "Telemetry"]
