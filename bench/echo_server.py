"""A bare grpc.aio server on uvloop: the baseline the coordinator's figures are divided by.

``/bench.Echo/Unary`` returns its request bytes; ``/bench.Echo/Stream`` streams a file in 1 MiB
chunks. Raw bytes, no protobuf: this is what gRPC itself costs. Run as
``python -m bench.echo_server --ready-file F [--stream-file MODEL]``; it writes its address to F and
serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import uvloop

UNARY_METHOD = "/bench.Echo/Unary"
STREAM_METHOD = "/bench.Echo/Stream"
STREAM_CHUNK_BYTES = 1024 * 1024


def server_options() -> list[tuple[str, int]]:
    """The channel arguments both this server and the coordinator process use."""
    return [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 * 1024**2)]


def _handlers(stream_file: Path | None) -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    async def stream(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        if stream_file is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "started without --stream-file")
            return
        with stream_file.open("rb") as source:
            # Reads from the page cache (the file was just written): as the coordinator's blob store does.
            while chunk := source.read(STREAM_CHUNK_BYTES):
                yield chunk

    return grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )


async def serve(ready_file: Path, stream_file: Path | None) -> None:
    """Serves the echo handlers until SIGTERM or SIGINT (see :func:`serve_until_signalled`)."""
    await serve_until_signalled(_handlers(stream_file), server_options(), ready_file)


async def serve_until_signalled(
    handlers: grpc.GenericRpcHandler, options: list[tuple[str, int]], ready_file: Path
) -> None:
    """Serves ``handlers`` on a free loopback port until SIGTERM or SIGINT.

    Writes ``{"address": ...}`` to ``ready_file`` once listening, for the parent process to read.
    """
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    partial = ready_file.with_suffix(".tmp")
    partial.write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
    partial.rename(ready_file)  # atomically: the parent never reads half a file
    await stop.wait()
    await server.stop(0)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--stream-file", type=Path)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.ready_file, args.stream_file))


if __name__ == "__main__":
    main()
