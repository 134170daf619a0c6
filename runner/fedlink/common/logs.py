"""Structured logging: console or JSON lines, with job/run/task/device ids and round as fields.

One format for the coordinator and the runner (``fedlink serve --log-format json``, ``fedlink runner
--log-format json``): it lives here, on the runner's side, because the runner never imports the server.

Modules log with ``logging.getLogger(__name__)`` as usual and never configure logging; only the CLI calls
:func:`configure_logging`. Ids reach the log in two ways: bound for a block of code with
:func:`bind` (kept in a ``contextvars`` variable, so each asyncio task and each gRPC call sees its own),
or per record with ``extra={"device_id": ...}``.

Never log tensors, model bytes, tokens, secrets or keys. As a safety net the formatters print byte
strings and arrays as a short summary (``<4096 bytes>``, ``<tensor float32 (10, 3)>``) and replace the
value of any field whose name looks like a credential (``token``, ``secret``, ``password``, ``cookie``,
...) with ``[redacted]``; messages themselves are the caller's responsibility.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Final, TextIO

#: The structured fields the coordinator and the runner bind, in the order they are printed.
FIELD_NAMES: Final = ("job_id", "run_id", "round", "task_id", "device_id")

_EMPTY: Final[Mapping[str, object]] = MappingProxyType({})
_fields: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "fedlink_log_fields", default=_EMPTY
)

# Every attribute a plain LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES: Final = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "fedlink_fields",
}
_SECRET_NAME: Final = re.compile(r"token|secret|passw|credential|authorization|cookie|private|api_?key", re.I)
_MAX_VALUE_CHARS: Final = 1000
# Libraries that log every statement at DEBUG; kept at INFO so DEBUG stays readable.
_CHATTY_LOGGERS: Final = ("asyncio", "hpack")


@contextmanager
def bind(**fields: object) -> Iterator[None]:
    """Adds ``fields`` to every record logged inside the ``with`` block (and tasks started in it).

    Example:
        ``with bind(job_id=job.id, device_id=device.id): log.info("task handed out")``
    """
    token = _fields.set(MappingProxyType({**_fields.get(), **fields}))
    try:
        yield
    finally:
        _fields.reset(token)


def bind_task(**fields: object) -> None:
    """Adds ``fields`` for the rest of the current context: in asyncio, the rest of the current task.

    Each asyncio task (and each grpc.aio call) runs in a copy of its creator's context, so this does not
    leak into other tasks; use it at the start of a task or RPC handler, :func:`bind` elsewhere.
    """
    _fields.set(MappingProxyType({**_fields.get(), **fields}))


def bound_fields() -> Mapping[str, object]:
    """The fields bound in the current context."""
    return _fields.get()


class ContextFieldsFilter(logging.Filter):
    """Stamps each record with the fields bound where it was logged (handlers may format it later)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Attaches the bound fields and lets the record through."""
        if not hasattr(record, "fedlink_fields"):
            record.fedlink_fields = _fields.get()
        return True


def record_fields(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields of a record, made safe to print: bound ones, overridden by ``extra=``."""
    merged: dict[str, object] = dict(getattr(record, "fedlink_fields", _EMPTY))
    for key, value in record.__dict__.items():
        if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
            merged[key] = value
    ordered: dict[str, object] = {name: merged.pop(name) for name in FIELD_NAMES if name in merged}
    ordered.update(sorted(merged.items()))
    return {key: _safe(key, value) for key, value in ordered.items()}


def _safe(key: str, value: object) -> object:
    if _SECRET_NAME.search(key):
        return "[redacted]"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"<tensor {dtype} {tuple(shape)}>"
    if value is None or isinstance(value, bool | int | float):
        return value
    text = str(value)
    return text if len(text) <= _MAX_VALUE_CHARS else f"{text[:_MAX_VALUE_CHARS]}…({len(text)} chars)"


def _timestamp(record: logging.LogRecord) -> datetime:
    return datetime.fromtimestamp(record.created, UTC)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Formats one record as a JSON line."""
        document: dict[str, object] = {
            "ts": _timestamp(record).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            document.setdefault(key, value)  # the four keys above are not overridden by a field
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, ensure_ascii=False, default=str)


class ConsoleFormatter(logging.Formatter):
    """``2024-05-01 12:00:00.123 INFO    logger: message job_id=... device_id=...`` (UTC times)."""

    def format(self, record: logging.LogRecord) -> str:
        """Formats one record as a readable line (plus the traceback, if any)."""
        when = _timestamp(record).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        line = f"{when} {record.levelname:<8} {record.name}: {record.getMessage()}"
        pairs = " ".join(f"{key}={_console_value(value)}" for key, value in record_fields(record).items())
        if pairs:
            line = f"{line} {pairs}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
        return line


def _console_value(value: object) -> str:
    text = "null" if value is None else str(value)
    # Quoted when it would not read back as one key=value token.
    if not text or any(c.isspace() or c in '="' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class _FedlinkHandler(logging.StreamHandler[TextIO]):
    """The handler configure_logging installs; its class marks it for replacement on reconfiguration."""


def configure_logging(
    format: str,
    level: str | int = "INFO",
    *,
    stream: TextIO | None = None,
    chatty: Sequence[str] = (),
    quiet: Sequence[str] = (),
) -> logging.Handler:
    """Sends every log record at ``level`` or above to ``stream`` in the chosen format (CLI only).

    Calling it again replaces the handler it installed before; other handlers are left alone.

    Args:
        format: ``console`` for people, ``json`` for log pipelines.
        level: A level name (``INFO``) or number.
        stream: Where to write; default: standard error.
        chatty: More loggers that log every statement at DEBUG: kept at INFO at least.
        quiet: Loggers whose INFO lines are their own business: kept at WARNING unless ``level`` is DEBUG.

    Returns:
        The installed handler.

    Raises:
        ValueError: an unknown format or level.
    """
    formatter: logging.Formatter
    if format == "json":
        formatter = JsonFormatter()
    elif format == "console":
        formatter = ConsoleFormatter()
    else:
        raise ValueError(f"log format must be console or json, not {format!r}")
    numeric = level if isinstance(level, int) else logging.getLevelNamesMapping().get(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = _FedlinkHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(ContextFieldsFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _FedlinkHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in (*_CHATTY_LOGGERS, *chatty):
        logging.getLogger(name).setLevel(max(numeric, logging.INFO))
    for name in quiet:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else logging.WARNING)
    return handler


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
