"""FedBuff against FedAvg on a real coordinator (issue 16): coordinator CPU per accepted update, and
model versions per second, at 1,000 and 10,000 devices.

Each run is a fresh ``bench.coordinator_process`` (the benches' stand-in for ``fedlink serve``, uvloop,
its own SQLite store) and one load process of bare devices (``bench/device_load.py``: GetTask, then
ReportResult of a 100-float WEIGHT_DIFF, until DONE), on the same sizes for both workflows:

- **FedAvg**: every device in every round, ``--rounds`` rounds; the window runs from the end of round
  1 to the last acknowledgement.
- **FedBuff**: a selection of ``min(devices, --selection)``, a model version every ``--updates``
  accepted updates, as many versions as make the same number of updates as FedAvg's run; the window
  runs from the selection's first fill being reported to the last acknowledgement. Devices outside the
  selection sit in long polls (30 s), as they would.
- **FedAvg, sampled** (where the selection is smaller than the fleet): FedAvg with FedBuff's load, the
  selection's number of devices sampled per round out of the same fleet, as many rounds as make the
  same number of results; the others sit in long polls as under FedBuff. Against it, the ratio is what
  FedBuff's own bookkeeping costs; against FedAvg over every device, the idle devices' polls count too.

CPU per accepted update = the coordinator's CPU in the window / the acknowledgements in it. Versions
per second: from the tenth version's event to the last one's (the first ones wait for the first
fill's reports). The run order alternates by repeat; ratios are taken within a repeat and medians
printed. Checked: every job finished; FedAvg's rounds each counted every device; FedBuff made every
version from at least ``--updates`` updates and counted no acknowledged update twice; every device was
told DONE; no RPC error.
Target: FedBuff's CPU per accepted update at most 1.2 x FedAvg's (over every device, as issue 16 set it;
the sampled FedAvg's ratio is printed beside it).

    .venv/bin/python -m bench.fedbuff_bench [--devices 1000,10000] [--repeats 3] [--json out.json]
    .venv/bin/python -m bench.fedbuff_bench --quick     # 200 devices, 100 selected, one repeat (tests)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import proc_stats
from bench.child_processes import LoadProcess, Profiler, ServerProcess
from bench.coordinator_admin import (
    FedAvgJob,
    FedBuffJob,
    admin_metadata,
    submit_job,
    upload_model,
    write_model_file,
)
from bench.protocol_bench import control_channel, coordinator_settings
from bench.replica_bench import until_running
from bench.report import num, targets_line
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import states_pb2

#: Issue 16's bound on FedBuff's coordinator CPU per accepted update, against FedAvg's per result.
CPU_RATIO_TARGET = 1.2
MODEL_FLOATS = 100
CHANNELS = 16
#: The devices' long-poll wait (the coordinator's max_task_wait is 30 s in these settings).
WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Sizes:
    """One run's sizes."""

    devices: int
    rounds: int
    selection: int
    updates: int

    @property
    def selected(self) -> int:
        return min(self.devices, self.selection)

    @property
    def versions(self) -> int:
        """FedBuff's versions: as many updates as FedAvg's rounds make."""
        return max(2, self.devices * self.rounds // self.updates)

    @property
    def sampled_rounds(self) -> int:
        """The sampled FedAvg's rounds of ``selected`` devices: as many results as FedAvg's (whole rounds)."""
        return self.devices * self.rounds // self.selected

    def fedavg_rounds(self, workflow: str) -> tuple[int, int]:
        """A FedAvg run's rounds and devices per round: every device, or (sampled) the selection's size."""
        if workflow == "fedavg-sampled":
            return self.sampled_rounds, self.selected
        return self.rounds, self.devices

    @property
    def workflows(self) -> tuple[str, ...]:
        """The runs of one repeat: the sampled FedAvg only where the selection leaves devices out."""
        return (
            ("fedavg", "fedbuff", "fedavg-sampled") if self.selected < self.devices else ("fedavg", "fedbuff")
        )


async def _events(control: cgrpc.ControlServiceAsyncStub, admin: Any, job_id: str) -> list[Any]:
    """The job's events, to its end."""
    events = []
    request = cpb.WatchJobRequest(job_id=job_id, after_sequence=0)
    async for event in control.WatchJob(request, metadata=admin):
        events.append(event)
        if event.state in (
            states_pb2.JOB_STATE_FINISHED,
            states_pb2.JOB_STATE_FAILED,
            states_pb2.JOB_STATE_ABORTED,
        ):
            break
    return events


async def run_once(sizes: Sizes, workflow: str, workdir: Path, profile: Path | None = None) -> dict[str, Any]:
    """One job of ``workflow`` on a fresh coordinator, its devices in one load process."""
    tag = f"{workflow}-{sizes.devices}"
    token = secrets.token_urlsafe(24)
    admin = admin_metadata(token)
    model = write_model_file(workdir / "model.bin", MODEL_FLOATS)
    job: FedAvgJob | FedBuffJob
    if workflow != "fedbuff":
        rounds, per_round = sizes.fedavg_rounds(workflow)
        job = FedAvgJob(
            name=tag,
            rounds=rounds,
            devices_per_round=per_round,
            min_results=per_round,
            min_devices=sizes.devices,  # the whole fleet enrolled and polling before round 1
            round_timeout_s=3600,
        )
        warm = per_round
    else:
        job = FedBuffJob(
            name=tag,
            max_model_version=sizes.versions,
            device_selection_size=sizes.selected,
            num_updates_for_model=sizes.updates,
        )
        warm = sizes.selected
    # A fresh data directory (and store) per run: devices enrolled by an earlier run would be sampled.
    data_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=workdir))
    settings = coordinator_settings(data_dir, admin_token=token)
    async with (
        ServerProcess("bench.coordinator_process", settings, workdir, tag) as coord,
        control_channel(coord.info["address"]) as control,
    ):
        await upload_model(control, admin, model)
        job_id = await submit_job(control, admin, model.sha256, job)
        await until_running(control, admin, job_id)
        spec = {
            "mode": "devices",
            "address": coord.info["address"],
            "channels": CHANNELS,
            "devices": sizes.devices,
            "job_name": tag,
            "wait_s": WAIT_S,
            "warm_acks": warm,
        }
        # FedBuff's first fill waits for a selection's worth of devices, FedAvg's first round for all.
        async with (
            Profiler(profile, coord.pid, tag),
            proc_stats.CpuTrace(coord.pid) as trace,
            LoadProcess(spec, workdir, f"{tag}-devices") as load,
        ):
            served = await load.event("result", timeout_s=3600)
            cpu_s = trace.between(*served["window"])
        events = await _events(control, admin, job_id)
    return _figures(sizes, workflow, served, cpu_s, events)


def _figures(
    sizes: Sizes, workflow: str, served: dict[str, Any], cpu_s: float, events: Sequence[Any]
) -> dict[str, Any]:
    acks = int(served["acks_in_window"])
    made = [e for e in events if e.WhichOneof("event") == "model_version"]
    closed = [e for e in events if e.WhichOneof("event") == "round_closed"]
    state = states_pb2.JobState.Name(events[-1].state) if events else "none"
    figures: dict[str, Any] = {
        "workflow": workflow,
        "devices": sizes.devices,
        "acks": served["acks"],
        "acks_in_window": acks,
        "window_s": served["window_s"],
        "coordinator_cpu_s": round(cpu_s, 3),
        "cpu_ms_per_update": round(1000 * cpu_s / acks, 4) if acks else None,
        "updates_per_s": round(acks / served["window_s"], 1) if served["window_s"] else None,
        "state": state,
        "rpc_latency": served["latency"],
    }
    if workflow == "fedbuff":
        times = [e.event_time.ToDatetime().timestamp() for e in made]
        span = times[-1] - times[len(times) // 10] if len(times) > 10 else 0.0
        figures["versions"] = len(made)
        # From the tenth version on: the first ones wait for the first fill's reports.
        figures["versions_per_s"] = round((len(times) - 1 - len(times) // 10) / span, 2) if span > 0 else None
        figures["checks"] = {
            "job_finished": state == "JOB_STATE_FINISHED" and len(made) == sizes.versions,
            # At least its K updates each (one accepted before its task's version fell out of the
            # history counts in the next version too); none counted twice.
            "every_version_of_its_updates": all(e.model_version.num_updates >= sizes.updates for e in made)
            and sum(e.model_version.num_updates for e in made) <= served["acks"],
        }
    else:
        rounds, per_round = sizes.fedavg_rounds(workflow)
        figures["checks"] = {
            "job_finished": state == "JOB_STATE_FINISHED" and len(closed) == rounds,
            "every_round_counted_its_devices": all(e.round_closed.num_results == per_round for e in closed),
        }
    figures["checks"] |= {
        "every_device_saw_done": served["outcomes"] == {"DONE": sizes.devices},
        "no_rpc_errors": not served["errors"],
    }
    return figures


def _ratio(buff: dict[str, Any], avg: dict[str, Any]) -> float | None:
    """FedBuff's CPU per update over a FedAvg run's per result."""
    a, b = avg["cpu_ms_per_update"], buff["cpu_ms_per_update"]
    return round(b / a, 3) if a and b else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


async def measure(
    sizes: Sequence[Sizes], repeats: int, workdir: Path, profile: Path | None = None
) -> dict[str, Any]:
    """Both workflows (and the sampled FedAvg) at every size, ``repeats`` times (their order alternating)."""
    report: dict[str, Any] = {"runs": [], "by_size": {}}
    for size in sizes:
        pairs: list[dict[str, Any]] = []
        for repeat in range(repeats):
            order = size.workflows if repeat % 2 == 0 else size.workflows[::-1]
            pair = {w: await run_once(size, w, workdir, profile) for w in order}
            ratio = _ratio(pair["fedbuff"], pair["fedavg"])
            to_sampled = _ratio(pair["fedbuff"], pair["fedavg-sampled"]) if "fedavg-sampled" in pair else None
            pairs.append({"ratio": ratio, "ratio_to_sampled": to_sampled, **pair})
            report["runs"].append(
                {
                    "devices": size.devices,
                    "repeat": repeat,
                    "ratio": ratio,
                    "ratio_to_sampled": to_sampled,
                    **pair,
                }
            )
        sampled = [p["fedavg-sampled"]["cpu_ms_per_update"] for p in pairs if "fedavg-sampled" in p]
        report["by_size"][str(size.devices)] = {
            "sizes": {
                "devices": size.devices,
                "rounds": size.rounds,
                "selection": size.selected,
                "updates_per_version": size.updates,
                "versions": size.versions,
            },
            "fedavg_cpu_ms_per_result": _median([p["fedavg"]["cpu_ms_per_update"] for p in pairs]),
            "fedbuff_cpu_ms_per_update": _median([p["fedbuff"]["cpu_ms_per_update"] for p in pairs]),
            "ratio": _median([p["ratio"] for p in pairs]),
            "fedavg_sampled_cpu_ms_per_result": _median(sampled),
            "ratio_to_sampled": _median([p["ratio_to_sampled"] for p in pairs]),
            "versions_per_s": _median([p["fedbuff"].get("versions_per_s") for p in pairs]),
            "fedavg_results_per_s": _median([p["fedavg"]["updates_per_s"] for p in pairs]),
            "fedbuff_updates_per_s": _median([p["fedbuff"]["updates_per_s"] for p in pairs]),
        }
    checks: Counter[str] = Counter()
    failed = []
    for run in report["runs"]:
        for workflow in [w for w in ("fedavg", "fedbuff", "fedavg-sampled") if w in run]:
            for name, ok in run[workflow]["checks"].items():
                checks[name] += 1
                if not ok:
                    failed.append(f"{workflow} at {run['devices']}: {name}")
    report["checks_failed"] = failed
    report["targets"] = {
        f"fedbuff_cpu_within_{CPU_RATIO_TARGET}x_fedavg_at_{d}": (
            None if r["ratio"] is None else r["ratio"] <= CPU_RATIO_TARGET
        )
        for d, r in report["by_size"].items()
    }
    return report


def summary(report: dict[str, Any]) -> str:
    lines = [
        "devices  FedAvg ms/result  FedBuff ms/update  ratio  versions/s  results/s  updates/s"
        "  sampled FedAvg ms/result  ratio to it"
    ]
    for devices, row in report["by_size"].items():
        lines.append(
            f"{int(devices):>7,}  {num(row['fedavg_cpu_ms_per_result'], '16.3f')}  "
            f"{num(row['fedbuff_cpu_ms_per_update'], '17.3f')}  {num(row['ratio'], '5.2f')}  "
            f"{num(row['versions_per_s'], '10.2f')}  {num(row['fedavg_results_per_s'], '9.0f')}  "
            f"{num(row['fedbuff_updates_per_s'], '9.0f')}  "
            f"{num(row['fedavg_sampled_cpu_ms_per_result'], '24.3f')}  "
            f"{num(row['ratio_to_sampled'], '11.2f')}"
        )
    for run in report["runs"]:
        avg, buff = run["fedavg"], run["fedbuff"]
        line = (
            f"    {run['devices']:,} repeat {run['repeat'] + 1}:"
            f" FedAvg {num(avg['cpu_ms_per_update'], '.3f')} ms,"
            f" FedBuff {num(buff['cpu_ms_per_update'], '.3f')} ms ({num(run['ratio'], '.2f')} x);"
            f" {buff.get('versions', 0)} versions, {num(buff.get('versions_per_s'), '.2f')}/s"
        )
        if "fedavg-sampled" in run:
            sampled = run["fedavg-sampled"]["cpu_ms_per_update"]
            line += f"; sampled FedAvg {num(sampled, '.3f')} ms ({num(run['ratio_to_sampled'], '.2f')} x)"
        lines.append(line)
    lines.append(targets_line(report["targets"]))
    failed = report["checks_failed"]
    lines.append("checks: all passed" if not failed else "checks FAILED: " + "; ".join(failed))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", default="1000,10000", help="fleet sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="FedAvg rounds (and FedBuff's updates)")
    parser.add_argument("--selection", type=int, default=1000, help="FedBuff's selection (at most)")
    parser.add_argument("--updates", type=int, default=100, help="FedBuff's updates per version")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="200 devices (a selection of 100), one repeat")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--profile", type=Path, help="py-spy every coordinator into DIR")
    args = parser.parse_args(argv)
    devices = [200] if args.quick else [int(d) for d in args.devices.split(",")]
    repeats = 1 if args.quick else args.repeats
    updates = 20 if args.quick else args.updates
    selection = 100 if args.quick else args.selection  # a selection smaller than the fleet, to sample
    sizes = [Sizes(d, args.rounds, selection, updates) for d in devices]
    with tempfile.TemporaryDirectory(prefix="fedlink-fedbuff-bench-") as folder:
        report = asyncio.run(measure(sizes, repeats, Path(folder), args.profile))
    report["config"] = {"devices": devices, "rounds": args.rounds, "repeats": repeats}
    print(summary(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True))
    return 1 if report["checks_failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
