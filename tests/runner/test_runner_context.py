"""Tests of the abort signal and the per-task context."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from fedlink.common.errors import FailedPrecondition
from fedlink.runner import Aborted, Context, ContextKey, EventType, Signal


def test_signal_starts_clear_and_check_passes() -> None:
    signal = Signal()
    assert not signal.triggered
    signal.check()


def test_signal_trigger_from_another_thread_wakes_a_waiter_and_check_raises_with_reason() -> None:
    signal = Signal()
    thread = threading.Thread(target=signal.trigger, args=("runner stopping",))
    thread.start()
    assert signal.wait(timeout=5)
    thread.join()
    assert signal.triggered
    with pytest.raises(Aborted, match="runner stopping"):
        signal.check()


def test_signal_keeps_the_first_reason() -> None:
    signal = Signal()
    signal.trigger("first")
    signal.trigger("second")
    assert signal.reason == "first"


class _Recorder:
    def __init__(self, name: str, log: list[tuple[str, str, Any]]) -> None:
        self.name = name
        self.log = log

    def handle_event(self, event_type: str, event_data: Any, ctx: Context) -> None:
        self.log.append((self.name, event_type, event_data))


def test_fire_event_calls_every_handler_in_order() -> None:
    log: list[tuple[str, str, Any]] = []
    ctx = Context({ContextKey.EVENT_HANDLERS: [_Recorder("a", log), _Recorder("b", log)]})
    ctx.fire_event(EventType.BEFORE_TRAIN, 1.5)
    assert log == [("a", "before_train", 1.5), ("b", "before_train", 1.5)]


def test_fire_event_without_handlers_does_nothing() -> None:
    Context().fire_event(EventType.AFTER_TRAIN, None)


def test_copy_is_a_context_and_independent() -> None:
    ctx = Context({ContextKey.TASK_NAME: "train"})
    task_ctx = ctx.copy()
    task_ctx[ContextKey.TASK_ID] = "t1"
    assert isinstance(task_ctx, Context)
    assert ContextKey.TASK_ID not in ctx
    assert task_ctx["task_name"] == "train"  # members are plain strings


def test_require_names_the_missing_key() -> None:
    with pytest.raises(FailedPrecondition, match="'data_source'"):
        Context().require(ContextKey.DATA_SOURCE)
