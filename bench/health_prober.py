"""Probes a gRPC server's health service at a fixed pace, in a process of its own, and times each probe.

``python -m bench.health_prober --address HOST:PORT [--interval-ms 20]`` writes ``{"event": "ready"}``
once its first probe was answered, then probes until its stdin is closed (or a line arrives on it),
and writes ``{"event": "result", ...}``: the count, p50/p99/max in milliseconds, how many probes took
longer than ``--slow-ms``, the slowest few with when they started (seconds since the first probe),
and the failures. A probe that has not been answered when the next one is due is still waited for,
so a stalled server shows as one long probe, not as missed ones.

In a process of its own so that what the caller does (building and sending large payloads on its
own event loop) is not measured as the server's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import grpc
import numpy as np
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc


def summary(latencies: list[float], slow_ms: float) -> dict[str, Any]:
    """Count, p50, p99 and max of latencies in seconds, in milliseconds, and how many were slow."""
    if not latencies:
        return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "slow": 0}
    values = np.asarray(latencies) * 1000.0
    return {
        "count": len(latencies),
        "p50_ms": round(float(np.percentile(values, 50)), 3),
        "p99_ms": round(float(np.percentile(values, 99)), 3),
        "max_ms": round(float(values.max()), 3),
        "slow": int((values > slow_ms).sum()),
    }


async def probe(address: str, interval_s: float, slow_ms: float) -> dict[str, Any]:
    """Probes until stdin closes; returns the summary."""
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.readline)
    latencies: list[float] = []
    starts: list[float] = []
    failures: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
        sys.stdout.write(json.dumps({"event": "ready"}) + "\n")
        sys.stdout.flush()
        first = time.perf_counter()
        next_at = first
        while not stop.done():
            started = time.perf_counter()
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    failures["NOT_SERVING"] = failures.get("NOT_SERVING", 0) + 1
            except grpc.aio.AioRpcError as error:
                failures[error.code().name] = failures.get(error.code().name, 0) + 1
            latencies.append(time.perf_counter() - started)
            starts.append(started - first)
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    slowest = sorted(range(len(latencies)), key=lambda i: latencies[i], reverse=True)[:5]
    return {
        **summary(latencies, slow_ms),
        "slowest": [{"at_s": round(starts[i], 3), "ms": round(latencies[i] * 1000, 3)} for i in slowest],
        "failures": failures,
        "window_s": round(time.perf_counter() - first, 3),
    }


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--slow-ms", type=float, default=100.0)
    args = parser.parse_args(argv)
    result = uvloop.run(probe(args.address, args.interval_ms / 1000.0, args.slow_ms))
    sys.stdout.write(json.dumps({"event": "result", **result}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
