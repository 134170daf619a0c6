"""The coordinator's structured logging: :mod:`fedlink.common.logs` (shared with the runner), with the
server's libraries kept in their place.

Modules log with ``logging.getLogger(__name__)`` as usual and never configure logging; only the CLI calls
:func:`configure_logging`. Ids reach the log bound for a block of code with :func:`bind` (each asyncio
task and each gRPC call sees its own), or per record with ``extra={"device_id": ...}``. Never log tensors,
model bytes, tokens, secrets or keys (the formatters summarise and redact as a safety net).
"""

from __future__ import annotations

import logging
from typing import Final, Literal, TextIO

from fedlink.common import logs
from fedlink.common.logs import (
    FIELD_NAMES,
    ConsoleFormatter,
    ContextFieldsFilter,
    JsonFormatter,
    bind,
    bind_task,
    bound_fields,
    record_fields,
)

# The store's driver logs every statement at DEBUG; kept at INFO so DEBUG stays readable.
_CHATTY_LOGGERS: Final = ("aiosqlite",)
# Libraries whose INFO lines are their own business (Alembic: a line per plugin and migration at
# every start); kept at WARNING unless fedlink logs at DEBUG. fedlink says what it upgraded itself.
_QUIET_LOGGERS: Final = ("alembic",)


def configure_logging(
    format: Literal["console", "json"], level: str | int = "INFO", *, stream: TextIO | None = None
) -> logging.Handler:
    """Sends every log record at ``level`` or above to ``stream`` in the chosen format (CLI only).

    Calling it again replaces the handler it installed before; other handlers are left alone.

    Args:
        format: ``console`` for people, ``json`` for log pipelines.
        level: A level name (``INFO``) or number.
        stream: Where to write; default: standard error.

    Returns:
        The installed handler.

    Raises:
        ValueError: an unknown format or level.
    """
    return logs.configure_logging(format, level, stream=stream, chatty=_CHATTY_LOGGERS, quiet=_QUIET_LOGGERS)


__all__ = [
    "FIELD_NAMES",
    "ConsoleFormatter",
    "ContextFieldsFilter",
    "JsonFormatter",
    "bind",
    "bind_task",
    "bound_fields",
    "configure_logging",
    "record_fields",
]
