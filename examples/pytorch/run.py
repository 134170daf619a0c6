"""fedlink's PyTorch example: FedAvg of a small CNN on scikit-learn's digits, from one job file, two ways.

The job is ``job.toml`` beside this file (20 rounds of the ``DigitsCNNTrainer`` of ``digits_cnn.py``);
every device trains on its own Dirichlet-skewed share (``alpha`` 0.5) of the 75% training split and,
after each round, evaluates the new global model on the 25% held-out split, which no device trains on.

* ``--mode simulate`` (the default, ``--devices 10``): ``fedlink simulate job.toml --devices 10
  --data digits.npz`` runs the job file on virtual devices; device ``i`` gets partition ``i``, split
  as the job file's ``[simulation]`` section says (Dirichlet, alpha 0.5, seed 0).
* ``--mode processes`` (``--devices 4``): ``fedlink serve`` (plaintext, open enrolment, SQLite in a
  temporary directory), ``fedlink job submit job.toml``, and one ``fedlink runner`` per device, each
  reading the same ``digits.npz`` and taking its own partition (``--partition-id I --num-partitions 4
  --partition dirichlet``); the runners import the trainer ``digits_cnn:DigitsCNNTrainer`` from this
  folder (``PYTHONPATH``), which ``--allow-components digits_cnn`` allows; ``fedlink job watch``
  follows the rounds and ``fedlink job download`` fetches the final model.

Both write ``digits.npz`` (the 75% training split and the 25% held out, which is never split: every
device evaluates on all of it) to the work folder first.

Either way it prints the held-out accuracy after every round (the devices' evaluation, averaged by
the coordinator), then the final model's accuracy computed here and the time taken. ``--json`` prints
the numbers as one JSON object on the last line instead (the tests read it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # mypy checks the tree from its root; run as a script, this folder is on sys.path
    from examples.pytorch.digits_cnn import Digits, accuracy
else:
    from digits_cnn import Digits, accuracy

HERE = Path(__file__).resolve().parent
JOB_FILE = HERE / "job.toml"
JOB_NAME = "pytorch-digits"  # the job file's name: runners take only this job
#: How the training split is shared among the devices: the job file's [simulation] section says the
#: same to ``fedlink simulate``.
ALPHA = 0.5
PARTITION_SEED = 0
#: The module the runners may import the job's trainer type from.
TRAINER_MODULE = "digits_cnn"
#: Bounds on the whole run, so that a broken setup fails instead of hanging.
JOB_DEADLINE_S = 600.0


def simulate(devices: int, work: Path) -> tuple[list[float], dict[str, Any]]:
    """``fedlink simulate`` of the job file on ``devices`` virtual devices; returns per-round accuracy
    and the final model."""
    metrics, final = work / "metrics.jsonl", work / "final.npz"
    command = [
        fedlink_executable(), "simulate", str(JOB_FILE), "--devices", str(devices),
        "--data", str(work / "digits.npz"), "--jsonl", str(metrics), "--save-model", str(final),
        "--timeout", str(JOB_DEADLINE_S), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"fedlink simulate failed: {done.stderr.strip()}")
    rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
    with np.load(final) as archive:
        arrays = {name: archive[name] for name in archive.files}
    return [float(r["metrics"]["eval_accuracy"]) for r in rounds], arrays


def fedlink_executable() -> str:
    """The ``fedlink`` console script of this interpreter's environment (else the one on PATH)."""
    beside = Path(sys.executable).parent / "fedlink"
    found = str(beside) if beside.exists() else shutil.which("fedlink")
    if found is None:
        raise SystemExit("cannot find the fedlink command: pip install 'fedlink[server,torch,examples]'")
    return found


def write_secret(path: Path, value: str) -> Path:
    """Writes a secret to a file only its owner may read (a flag's value would be in the process list)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(value + "\n")
    return path


def start_coordinator(fedlink: str, data_dir: Path, admin_token: Path) -> tuple[subprocess.Popen[str], str]:
    """``fedlink serve`` on a free port; returns the process and its address once it listens."""
    command = [
        fedlink, "serve", "--insecure", "--open-enrolment", "--listen-address", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--admin-token-file", str(admin_token), "--keep-checkpoints", "100",
        "--shutdown-grace", "2s", "--log-level", "WARNING",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "listening on" in line:
            return process, line.split("listening on", 1)[1].split()[0]
    raise SystemExit(f"the coordinator did not start (exit status {process.wait()})")


def start_devices(fedlink: str, address: str, work: Path, devices: int) -> list[subprocess.Popen[bytes]]:
    """One ``fedlink runner`` per device: the same data file, each its own partition and state directory,
    this folder on its module path and the trainer's module allowed."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    processes = []
    for i in range(devices):
        log = (work / f"device-{i}.log").open("wb")
        command = [
            fedlink, "runner", "--server", address, "--insecure", "--allow-components", TRAINER_MODULE,
            "--state-dir", str(work / f"device-{i}"), "--data", str(work / "digits.npz"),
            "--partition-id", str(i), "--num-partitions", str(devices), "--partition", "dirichlet",
            "--partition-alpha", str(ALPHA), "--partition-seed", str(PARTITION_SEED),
            "--job-name", JOB_NAME, "--job-timeout", "120s", "--task-wait", "5s",
            "--device-info", f"site=device-{i}", "--log-level", "WARNING",
        ]  # fmt: skip
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment))
    return processes


def run_processes(devices: int, work: Path, *, quiet: bool) -> tuple[list[float], dict[str, Any]]:
    """Runs the job on ``fedlink serve`` and ``devices`` device processes; returns as :func:`simulate`."""
    fedlink = fedlink_executable()
    token = write_secret(work / "admin-token", uuid.uuid4().hex)
    coordinator, address = start_coordinator(fedlink, work / "coordinator", token)
    connection = ["--server", address, "--insecure", "--admin-token-file", str(token)]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        submitted = subprocess.run(
            [fedlink, "job", "submit", str(JOB_FILE), *connection],
            capture_output=True,
            text=True,
            check=False,
        )
        if submitted.returncode != 0:
            raise SystemExit(f"fedlink job submit failed: {submitted.stderr.strip()}")
        job_id = submitted.stdout.strip().splitlines()[-1]
        if not quiet:
            print(f"coordinator on {address}; job {job_id}")
        processes = start_devices(fedlink, address, work, devices)
        per_round = watch(fedlink, job_id, connection, quiet=quiet)
        final = work / "final.npz"
        subprocess.run(
            [fedlink, "job", "download", job_id, "-o", str(final), *connection],
            capture_output=True,
            check=True,
        )
        with np.load(final) as archive:
            arrays = {name: archive[name] for name in archive.files}
    finally:
        for process in processes:
            try:
                process.wait(timeout=30)  # the session is over: each device leaves by itself
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=30)
            if process.returncode != 0:
                print(
                    f"a device exited with status {process.returncode} (see {work}/device-*.log)",
                    file=sys.stderr,
                )
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(timeout=30)
    return per_round, arrays


def watch(fedlink: str, job_id: str, connection: list[str], *, quiet: bool) -> list[float]:
    """Follows ``fedlink job watch --format json`` to the job's end; returns each round's accuracy."""
    command = [fedlink, "job", "watch", job_id, "--no-results", "--format", "json", *connection]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(JOB_DEADLINE_S, process.kill)
    timer.start()
    per_round: list[float] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            event = json.loads(line)
            if event["event"] == "round_closed":
                per_round.append(float(event["metrics"]["eval_accuracy"]))
                if not quiet:
                    print(f"round {event['round']:2d}: held-out accuracy {per_round[-1]:.4f}")
            elif event["event"] == "job_state_changed" and event["state"] in ("FAILED", "ABORTED"):
                raise SystemExit(f"job {job_id} ended {event['state']}: {event['message']}")
    finally:
        timer.cancel()
    if process.wait() != 0:
        raise SystemExit(f"job {job_id} did not finish (fedlink job watch exited {process.returncode})")
    return per_round


def main() -> int:
    """Runs the example; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("simulate", "processes"), default="simulate")
    parser.add_argument("--devices", type=int, help="devices (default: 10 simulated, 4 processes)")
    parser.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--save-model", type=Path, help="write the final model's arrays to this .npz file")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON on the last line")
    args = parser.parse_args()
    devices = args.devices or (10 if args.mode == "simulate" else 4)

    started = time.perf_counter()
    digits = Digits.load()
    sizes = digits.partition_sizes(devices, alpha=ALPHA, seed=PARTITION_SEED)
    if not args.json:
        print(f"{args.mode}: {devices} devices with {sizes} training samples; {len(digits.y_test)} held out")
    with tempfile.TemporaryDirectory(prefix="fedlink-pytorch-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        digits.save(work / "digits.npz")
        if args.mode == "simulate":
            per_round, arrays = simulate(devices, work)
            if not args.json:
                for round_no, value in enumerate(per_round, 1):
                    print(f"round {round_no:2d}: held-out accuracy {value:.4f}")
        else:
            per_round, arrays = run_processes(devices, work, quiet=args.json)
    final = accuracy(arrays, digits.x_test, digits.y_test)
    seconds = time.perf_counter() - started
    if args.save_model is not None:
        with args.save_model.open("wb") as file:
            np.savez(file, allow_pickle=False, **arrays)
    if args.json:
        summary = {
            "mode": args.mode,
            "devices": devices,
            "per_round": per_round,
            "final": final,
            "partition_sizes": sizes,
            "seconds": seconds,
        }
        print(json.dumps(summary))
    else:
        print(f"final global model: held-out accuracy {final:.4f} (computed here); {seconds:.1f} s in all")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
