"""A bare grpc.aio server on uvloop that swallows a client-streaming upload: the blob upload's baseline.

``/bench.Sink/Upload`` takes raw byte chunks (no protobuf) and answers the number of bytes it got
as ASCII digits: what gRPC itself costs to move an upload, with no hashing and no disk. Run as
``python -m bench.upload_sink --ready-file F``; it writes ``{"address": ...}`` to F and serves until
SIGTERM.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import uvloop

from bench.echo_server import serve_until_signalled

UPLOAD_METHOD = "/bench.Sink/Upload"


def _handlers() -> grpc.GenericRpcHandler:
    async def upload(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        received = 0
        async for chunk in requests:
            received += len(chunk)
        return str(received).encode()

    return grpc.method_handlers_generic_handler(
        "bench.Sink", {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
    )


async def serve(ready_file: Path) -> None:
    """Counts uploads until SIGTERM or SIGINT, after writing ``{"address": ...}`` to ``ready_file``."""
    # The coordinator's options: no port sharing, messages up to 64 MiB.
    options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 * 1024**2)]
    await serve_until_signalled(_handlers(), options, ready_file)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.ready_file))


if __name__ == "__main__":
    main()
