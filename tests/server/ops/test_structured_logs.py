"""Structured logs: JSON and console lines carry bound and extra fields, never secrets or tensors."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import numpy as np
import pytest

from fedlink.server.logs import bind, bind_task, bound_fields, configure_logging

log = logging.getLogger("fedlink.server.test_structured_logs")


@pytest.fixture
def output() -> Iterator[io.StringIO]:
    """A fresh stream; the levels and handlers configure_logging touches are restored afterwards."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    loggers = [root, *(logging.getLogger(name) for name in ("aiosqlite", "asyncio", "hpack"))]
    levels = [logger.level for logger in loggers]
    stream = io.StringIO()
    yield stream
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


def _json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_core_keys_bound_and_extra_fields(output: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=output)
    with bind(job_id="j1", run_id="r1"):
        log.info("task %s handed out", "t9", extra={"device_id": "d7", "round": 3, "task_id": "t9"})
    log.info("outside")
    log.debug("below the level")

    first, second = _json_lines(output)
    assert first["message"] == "task t9 handed out"
    assert first["level"] == "INFO"
    assert first["logger"] == "fedlink.server.test_structured_logs"
    assert isinstance(first["ts"], str) and first["ts"].endswith("Z") and "T" in first["ts"]
    assert {k: first[k] for k in ("job_id", "run_id", "round", "task_id", "device_id")} == {
        "job_id": "j1",
        "run_id": "r1",
        "round": 3,
        "task_id": "t9",
        "device_id": "d7",
    }
    assert second["message"] == "outside"
    assert "job_id" not in second  # the binding ended with its block


def test_extra_overrides_bound_fields_and_bindings_nest(output: io.StringIO) -> None:
    configure_logging("json", "DEBUG", stream=output)
    with bind(job_id="outer", device_id="d1"), bind(job_id="inner"):
        assert bound_fields() == {"job_id": "inner", "device_id": "d1"}
        log.debug("one", extra={"device_id": "d2"})
    (line,) = _json_lines(output)
    assert (line["job_id"], line["device_id"], line["level"]) == ("inner", "d2", "DEBUG")


def test_exceptions_are_included(output: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=output)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("store failed", extra={"job_id": "j1"})
    (line,) = _json_lines(output)
    assert line["message"] == "store failed"
    assert isinstance(line["exception"], str) and "RuntimeError: boom" in line["exception"]


def test_secrets_and_tensors_are_never_printed(output: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=output)
    log.info(
        "enrolled",
        extra={
            "device_token": "tok-abc",
            "join_secret": "js-abc",
            "cookie": b"signed",
            "weights": np.zeros((10, 3), dtype=np.float32),
            "payload": b"\x00" * 4096,
        },
    )
    text = output.getvalue()
    assert "tok-abc" not in text and "js-abc" not in text and "signed" not in text
    (line,) = _json_lines(output)
    assert line["device_token"] == line["join_secret"] == line["cookie"] == "[redacted]"
    assert line["weights"] == "<tensor float32 (10, 3)>"
    assert line["payload"] == "<4096 bytes>"


def test_console_lines_append_fields_as_key_value(output: io.StringIO) -> None:
    configure_logging("console", "INFO", stream=output)
    with bind(job_id="j1", device_id="d1"):
        log.warning("lease expired", extra={"task_id": "t1", "reason": "no report in 5m"})
    line = output.getvalue().rstrip("\n")
    assert " WARNING  fedlink.server.test_structured_logs: lease expired " in line
    assert line.endswith('job_id=j1 task_id=t1 device_id=d1 reason="no report in 5m"')


def test_reconfiguring_replaces_the_handler(output: io.StringIO) -> None:
    first = io.StringIO()
    configure_logging("console", "INFO", stream=first)
    configure_logging("json", "WARNING", stream=output)
    log.info("filtered")
    log.warning("kept")
    assert first.getvalue() == ""
    assert [line["message"] for line in _json_lines(output)] == ["kept"]
    assert sum(type(h).__name__ == "_FedlinkHandler" for h in logging.getLogger().handlers) == 1


def test_bad_format_or_level_is_refused(output: io.StringIO) -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml", "INFO", stream=output)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("json", "LOUD", stream=output)


async def test_bound_fields_stay_with_their_asyncio_task(output: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=output)
    both_bound = asyncio.Barrier(2)

    async def handle(device_id: str) -> None:
        bind_task(device_id=device_id)  # as an RPC handler would at its start
        await both_bound.wait()  # the other task has bound its own id by now
        log.info("polled")
        with bind(task_id=f"task-of-{device_id}"):
            await asyncio.sleep(0)
            log.info("reported")

    with bind(job_id="j1"):
        await asyncio.gather(handle("d1"), handle("d2"))
    assert bound_fields() == {}  # nothing leaked into the caller's context

    lines = _json_lines(output)
    assert len(lines) == 4
    for line in lines:
        assert line["job_id"] == "j1"  # inherited from the context the tasks were created in
        if line["message"] == "reported":
            assert line["task_id"] == f"task-of-{line['device_id']}"
    assert sorted(str(line["device_id"]) for line in lines) == ["d1", "d1", "d2", "d2"]
