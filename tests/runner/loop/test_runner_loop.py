"""The Runner against a real in-process coordinator over real gRPC (plaintext, 127.0.0.1:0)."""

from __future__ import annotations

import asyncio
import stat
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.common.dxo import DXO
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.context import Context, ContextKey, EventType, Signal
from fedlink.runner.data import NpzDataSource
from fedlink.runner.loop import Runner
from fedlink.v1 import states_pb2

from .conftest import (
    Control,
    coordinator_settings,
    digits_npz,
    serving,
    softmax_job,
    transport,
    zero_softmax_model,
)


def make_runner(control: Control, state_dir: Path, data: Path | None, **kwargs: Any) -> Runner:
    kwargs.setdefault("job_timeout", 3.0)
    return Runner(
        kwargs.pop("job_name", ""),
        NpzDataSource(data) if data is not None else None,
        {"platform": "test"},
        {},
        transport=transport(control.address, state_dir),
        **kwargs,
    )


async def results_of(control: Control, job_id: str) -> list[Any]:
    store = control.coordinator.store
    assert store is not None
    run = await store.get_current_run(job_id)
    return list(await store.list_results(run_id=run.run_id, accepted_only=False))


async def test_three_runners_take_a_fedavg_job_to_finished(control: Control, tmp_path: Path) -> None:
    parts = digits_npz(tmp_path, 3)
    job_id = await control.submit(zero_softmax_model(), softmax_job(), rounds=3, devices=3)
    runners = [make_runner(control, tmp_path / f"state{i}", p, job_timeout=2.0) for i, p in enumerate(parts)]
    await asyncio.wait_for(asyncio.gather(*(r.run_async() for r in runners)), timeout=60)

    job = await control.describe(job_id)
    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    assert job.current_round == 3
    for runner in runners:
        assert [r.outcome for r in runner.history] == ["SUCCEEDED"] * 3
        assert all(r.ack == "OK" for r in runner.history)
    results = await results_of(control, job_id)
    assert len(results) == 9 and all(r.accepted for r in results)
    final = await control.model(job_id)
    assert np.abs(final.data["weight"]).sum() > 0  # the devices' updates reached the global model


class Exploding:
    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        raise ValueError("boom 42")


class ReturnsNumber:
    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> Any:
        return 7


class GarbageFilter:
    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> Any:
        return {"not": "a dxo"}


class EventLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def handle_event(self, event_type: str, event_data: Any, ctx: Context) -> None:
        self.events.append((event_type, str(ctx.get(ContextKey.TASK_ID))))


REGISTRY = ResolverRegistry(
    {"Exploding": Exploding, "ReturnsNumber": ReturnsNumber, "Garbage": GarbageFilter}
)


@pytest.mark.parametrize(
    ("job_data", "message"),
    [
        (
            {"components": [{"type": "Exploding", "name": "x"}], "executors": {"*": "@x"}},
            "ValueError: boom 42",
        ),
        (
            {"components": [{"type": "ReturnsNumber", "name": "x"}], "executors": {"*": "@x"}},
            "executor ReturnsNumber returned int, not a DXO",
        ),
        (
            {
                "components": [
                    {"type": "SoftmaxRegressionTrainer", "name": "t"},
                    {"type": "Garbage", "name": "g"},
                ],
                "executors": {"*": "@t"},
                "out_filters": ["@g"],
            },
            "out-filter #0 (GarbageFilter) returned dict, not a DXO",
        ),
        (
            # Well-formed, so the coordinator takes it; this runner allows no module to be imported.
            {"components": [{"type": "json:JSONDecoder", "name": "x"}], "executors": {"*": "@x"}},
            "job config: ComponentNotAllowed: component 'x' has type 'json:JSONDecoder' from module 'json', "
            "which this runner does not allow",
        ),
    ],
    ids=["raises", "not-a-dxo", "garbage-filter", "module-not-allowed"],
)
async def test_a_broken_task_is_reported_failed_with_its_cause(
    control: Control, tmp_path: Path, job_data: dict[str, Any], message: str
) -> None:
    [part] = digits_npz(tmp_path, 1)
    job_id = await control.submit(zero_softmax_model(), job_data, devices=1)
    runner = make_runner(control, tmp_path / "state", part, resolver_registry=REGISTRY)
    task = asyncio.create_task(runner.run_async())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if runner.history:
            break
        await asyncio.sleep(0.02)
    runner.stop()
    await asyncio.wait_for(task, 10)  # the runner itself did not crash

    assert runner.history and runner.history[0].outcome == "FAILED"
    assert message in runner.history[0].error
    failed = [r for r in await results_of(control, job_id) if r.status.value == "FAILED"]
    assert failed, "the coordinator has no failed result"
    assert message in failed[0].error_message
    if message.startswith("job config:"):  # said once, not behind another error's name
        assert failed[0].error_message.startswith(message)


async def test_a_component_type_from_an_allowed_module_is_imported_and_trains(
    control: Control, tmp_path: Path
) -> None:
    [part] = digits_npz(tmp_path, 1)
    job_data = softmax_job()
    job_data["components"][0]["type"] = "fedlink.runner.executors:SoftmaxRegressionTrainer"
    job_id = await control.submit(zero_softmax_model(), job_data, devices=1)
    runner = make_runner(control, tmp_path / "state", part, allow_components=["fedlink.runner.*"])
    await asyncio.wait_for(runner.run_async(), 30)
    assert [r.outcome for r in runner.history] == ["SUCCEEDED"], runner.history
    assert (await control.describe(job_id)).state == states_pb2.JOB_STATE_FINISHED


async def test_the_coordinator_refuses_at_submission_what_every_device_would_fail_on(
    control: Control,
) -> None:
    # What used to be accepted and then fail on every device: a misspelt type, a task (train) with
    # no executor, a reference to nothing.
    refused = {
        "did you mean 'SoftmaxRegressionTrainer'": {
            "components": [{"type": "SoftmaxRegresionTrainer", "name": "t"}],
            "executors": {"*": "@t"},
        },
        "no executor for task 'train', which the fedavg workflow sends": {
            "components": [{"type": "SoftmaxRegressionTrainer", "name": "t"}],
            "executors": {"evaluate": "@t"},
        },
        "references undefined component '@dp'": {
            "components": [{"type": "SoftmaxRegressionTrainer", "name": "t"}],
            "executors": {"*": "@t"},
            "out_filters": ["@dp"],
        },
    }
    for fragment, job_data in refused.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await control.submit(zero_softmax_model(), job_data)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert fragment in str(info.value.details()), info.value.details()


async def test_filters_and_events_run_in_order(control: Control, tmp_path: Path) -> None:
    order: list[str] = []

    class Tag:
        def __init__(self, name: str) -> None:
            self.name = name

        def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
            order.append(self.name)
            return dxo

    log = EventLog()
    registry = ResolverRegistry(
        {"JobIn": lambda: Tag("job-in"), "JobOut": lambda: Tag("job-out"), "Log": lambda: log}
    )
    job_data = softmax_job()
    job_data["components"] += [
        {"type": "JobIn", "name": "ji"},
        {"type": "JobOut", "name": "jo"},
        {"type": "Log", "name": "log"},
    ]
    job_data.update(in_filters=["@ji"], out_filters=["@jo"], handlers=["@log"])
    [part] = digits_npz(tmp_path, 1)
    job_id = await control.submit(zero_softmax_model(), job_data, devices=1)
    runner = make_runner(
        control,
        tmp_path / "state",
        part,
        job_timeout=1.0,
        resolver_registry=registry,
        in_filters=[Tag("app-in")],
        out_filters=[Tag("app-out")],
        partition_id=0,
        num_partitions=1,
    )
    await asyncio.wait_for(runner.run_async(), 30)

    assert (await control.describe(job_id)).state == states_pb2.JOB_STATE_FINISHED
    assert order == ["app-in", "job-in", "app-out", "job-out"]
    task_id = runner.history[0].task_id
    assert (EventType.BEFORE_TRAIN, task_id) in log.events
    kinds = [kind for kind, _ in log.events]
    assert kinds.index(EventType.BEFORE_TRAIN) < kinds.index(EventType.AFTER_TRAIN)
    assert EventType.LOSS_GENERATED in kinds


async def test_identity_is_kept_across_restarts(control: Control, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = transport(control.address, state)
    await first.open()
    device_id = first.device_id
    await first.close()
    again = transport(control.address, state)
    await again.open()
    assert again.device_id == device_id
    await again.close()
    mode = (state / "identity.json").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    other = transport(control.address, tmp_path / "other")
    await other.open()
    assert other.device_id != device_id
    await other.close()


async def test_no_job_ends_the_session_after_the_job_timeout(control: Control, tmp_path: Path) -> None:
    runner = make_runner(control, tmp_path / "state", None, job_timeout=1.0)
    started = time.monotonic()
    await asyncio.wait_for(runner.run_async(), 10)
    assert 0.5 <= time.monotonic() - started < 5
    assert runner.history == []


async def test_a_finished_named_job_ends_the_session_at_once(control: Control, tmp_path: Path) -> None:
    [part] = digits_npz(tmp_path, 1)
    job_id = await control.submit(zero_softmax_model(), softmax_job(), devices=1, name="digits")
    first = make_runner(control, tmp_path / "state", part, job_name="digits", job_timeout=60.0)
    started = time.monotonic()
    await asyncio.wait_for(first.run_async(), 30)
    # GetTask said DONE, then GetJob said DONE for the finished job: no 60 s job-discovery wait.
    assert time.monotonic() - started < 20
    assert (await control.describe(job_id)).state == states_pb2.JOB_STATE_FINISHED


def test_stop_from_another_thread_ends_a_long_poll(control: Control, tmp_path: Path) -> None:
    runner = make_runner(control, tmp_path / "state", None, job_timeout=3600.0)
    thread = threading.Thread(target=runner.run)
    thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    runner.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - started < 2


class _Slow:
    """Takes longer than the coordinator's lease, then returns the model unchanged."""

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        time.sleep(1.5)
        return DXO(kind=dxo.kind, data={k: v.copy() for k, v in dxo.data.items()}, meta={"num_examples": 1})


async def test_a_task_longer_than_its_lease_keeps_it_by_renewing(tmp_path: Path) -> None:
    # The lease (0.6 s) runs out three times over while the task runs, and the reaper sweeps every
    # 0.1 s: only renewals (every third of the lease, the first one from a timer) keep the result in.
    settings = coordinator_settings(
        tmp_path / "coordinator", lease=timedelta(seconds=0.6), reaper_interval=timedelta(seconds=0.1)
    )
    async with serving(settings) as control:
        job_id = await control.submit(
            zero_softmax_model(),
            {"components": [{"type": "Slow", "name": "s"}], "executors": {"*": "@s"}},
        )
        runner = make_runner(
            control, tmp_path / "state", None, resolver_registry=ResolverRegistry({"Slow": _Slow})
        )
        await asyncio.wait_for(runner.run_async(), timeout=30)
        results = await results_of(control, job_id)
    assert [r.outcome for r in runner.history] == ["SUCCEEDED"]
    assert [(r.accepted, r.stale) for r in results] == [(True, False)]
