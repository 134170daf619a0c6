"""fedlink quickstart: FedAvg of a softmax regression on scikit-learn's digits, across real processes.

What it does, in order:

1. Loads the 1,797 8x8 digit images bundled with scikit-learn (no download) and holds out a stratified
   test split that no device ever sees; the rest goes to ``digits.npz`` (``x_train``/``y_train``).
2. Starts a coordinator (``fedlink serve --insecure --open-enrolment``) on a free port, with its SQLite
   store in a temporary data directory.
3. Submits ``job.toml`` beside this file with ``fedlink job submit``: FedAvg of the built-in
   ``SoftmaxRegressionTrainer``, every device every round, every round's model kept.
4. Starts one ``fedlink runner`` per device, each reading the same ``digits.npz`` and training on its
   own partition of it, split with label skew (``--partition dirichlet --partition-alpha 0.5``): each
   device sees mostly a few digits. ``fedlink simulate job.toml --data digits.npz`` splits it the same
   way (the job file's ``[simulation]`` section).
5. Follows the job with ``fedlink job watch``; when it is finished, downloads each round's global model
   with ``fedlink job download`` and prints its accuracy on the held-out split, then the final
   accuracy; stops everything and exits 0.

Run it with ``python examples/quickstart/run.py`` (under a minute on two busy cores). ``--devices``,
``--rounds``, ``--alpha`` and ``--seed`` other than the job file's submit a copy of it with those
changed. ``--json`` prints the numbers as one JSON object on the last line instead (the tests read it).
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
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fedlink.common.dxo import DXO, DataKind
from fedlink.runner.data.partition import all_partitions

HERE = Path(__file__).resolve().parent
JOB_FILE = HERE / "job.toml"
JOB: dict[str, Any] = tomllib.loads(JOB_FILE.read_text())
JOB_NAME: str = JOB["name"]
#: The trainer's arguments, as the job file gives them.
TRAINER_ARGS: dict[str, Any] = dict(JOB["job_data"]["components"][0]["args"])
#: How long the whole job may take before the quickstart gives up.
JOB_DEADLINE_S = 300.0


@dataclass(frozen=True)
class Split:
    """The federated data: one (x, y) per device, and the held-out test split."""

    partitions: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]]
    x_test: npt.NDArray[np.float32]
    y_test: npt.NDArray[np.int64]


def federated_digits(
    seed: int,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Digits scaled to [0, 1]: the federated 75% and the held-out 25% (stratified), as x, y, x, y."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    x_fed, x_test, y_fed, y_test = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    return x_fed, y_fed, x_test, y_test


def split_digits(devices: int, alpha: float, seed: int) -> Split:
    """The devices' partitions of the federated digits, as ``fedlink runner --partition dirichlet
    --partition-alpha ALPHA --partition-seed SEED`` cuts them, and the held-out split."""
    x_fed, y_fed, x_test, y_test = federated_digits(seed)
    parts = all_partitions(y_fed, devices, method="dirichlet", alpha=alpha, seed=seed)
    return Split([(x_fed[p], y_fed[p]) for p in parts], x_test, y_test)


def accuracy(model: DXO, x: npt.NDArray[np.float32], y: npt.NDArray[np.int64]) -> float:
    """Top-1 accuracy of a softmax regression model (``weight``, ``bias``)."""
    logits = x @ model.data["weight"] + model.data["bias"]
    return float(np.mean(np.argmax(logits, axis=1) == y))


def fedlink_executable() -> str:
    """The ``fedlink`` console script of this interpreter's environment (else the one on PATH)."""
    beside = Path(sys.executable).parent / "fedlink"
    found = str(beside) if beside.exists() else shutil.which("fedlink")
    if found is None:
        raise SystemExit("cannot find the fedlink command: pip install 'fedlink[server]'")
    return found


def write_secret(path: Path, value: str) -> Path:
    """Writes a secret to a file only its owner may read (a flag's value would be in the process list)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(value + "\n")
    return path


def job_file(work: Path, devices: int, rounds: int) -> Path:
    """``job.toml`` itself, or a copy (JSON, a job file too) with the device and round counts changed."""
    fedavg = JOB["fedavg"]
    if (devices, rounds) == (fedavg["devices_per_round"], fedavg["num_rounds"]):
        return JOB_FILE
    changed = {**JOB, "model": str(HERE / JOB["model"])}
    changed["fedavg"] = {
        **fedavg,
        "num_rounds": rounds,
        "keep_checkpoints": rounds,
        "devices_per_round": devices,
        "min_results": devices,
    }
    path = work / "job.json"
    path.write_text(json.dumps(changed, indent=2))
    return path


def start_coordinator(fedlink: str, data_dir: Path, admin_token: Path) -> tuple[subprocess.Popen[str], str]:
    """``fedlink serve`` on a free port; returns the process and its address once it listens."""
    command = [
        fedlink, "serve", "--insecure", "--open-enrolment", "--listen-address", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--admin-token-file", str(admin_token), "--shutdown-grace", "2s",
        "--log-level", "WARNING",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "listening on" in line:
            return process, line.split("listening on", 1)[1].split()[0]
    raise SystemExit(f"the coordinator did not start (exit status {process.wait()})")


def fedlink_cli(fedlink: str, *args: str, connection: list[str]) -> str:
    """Runs ``fedlink ARGS`` against the coordinator; its standard output (exits on a failure)."""
    done = subprocess.run([fedlink, *args, *connection], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"fedlink {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def start_runners(
    fedlink: str, address: str, work: Path, devices: int, alpha: float, seed: int
) -> list[subprocess.Popen[bytes]]:
    """One ``fedlink runner`` per device: the same data file, each its own partition and state directory."""
    runners = []
    for i in range(devices):
        log = (work / f"runner-{i}.log").open("wb")
        command = [
            fedlink, "runner", "--server", address, "--insecure", "--state-dir", str(work / f"runner-{i}"),
            "--data", str(work / "digits.npz"), "--partition-id", str(i), "--num-partitions", str(devices),
            "--partition", "dirichlet", "--partition-alpha", str(alpha), "--partition-seed", str(seed),
            "--job-name", JOB_NAME, "--job-timeout", "60s", "--task-wait", "5s",
            "--device-info", f"site=device-{i}",
        ]  # fmt: skip
        runners.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    return runners


def watch(fedlink: str, job_id: str, connection: list[str]) -> None:
    """Follows ``fedlink job watch --format json`` until the job finishes (exits if it fails)."""
    command = [fedlink, "job", "watch", job_id, "--no-results", "--format", "json", *connection]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(JOB_DEADLINE_S, process.kill)
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            event = json.loads(line)
            if event["event"] == "job_state_changed" and event["state"] in ("FAILED", "ABORTED"):
                raise SystemExit(f"job {job_id} ended {event['state']}: {event['message']}")
    finally:
        timer.cancel()
        if process.poll() is None:
            process.kill()
    if process.wait() != 0:
        raise SystemExit(f"job {job_id} did not finish (fedlink job watch exited {process.returncode})")


def download(fedlink: str, job_id: str, round_no: int, work: Path, connection: list[str]) -> DXO:
    """The global model after ``round_no`` (0: the final one), through ``fedlink job download``."""
    path = work / f"round-{round_no}.npz"
    fedlink_cli(
        fedlink, "job", "download", job_id, "--round", str(round_no), "-o", str(path), connection=connection
    )
    with np.load(path) as archive:
        return DXO(kind=DataKind.WEIGHTS, data={name: archive[name] for name in archive.files})


def main() -> int:
    """Runs the quickstart; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    simulation = JOB["simulation"]
    parser.add_argument("--devices", type=int, default=JOB["fedavg"]["devices_per_round"])
    parser.add_argument("--rounds", type=int, default=JOB["fedavg"]["num_rounds"])
    parser.add_argument(
        "--alpha",
        type=float,
        default=simulation["partition_alpha"],
        help="Dirichlet label skew (smaller: more)",
    )
    parser.add_argument("--seed", type=int, default=simulation["partition_seed"])
    parser.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON on the last line")
    args = parser.parse_args()

    x_fed, y_fed, x_test, y_test = federated_digits(args.seed)
    sizes = [len(y) for _, y in split_digits(args.devices, args.alpha, args.seed).partitions]
    with tempfile.TemporaryDirectory(prefix="fedlink-quickstart-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with (work / "digits.npz").open("wb") as file:
            np.savez(file, x_train=x_fed, y_train=y_fed)  # the held-out split stays here
        fedlink = fedlink_executable()
        token = write_secret(work / "admin-token", uuid.uuid4().hex)
        coordinator, address = start_coordinator(fedlink, work / "coordinator", token)
        connection = ["--server", address, "--insecure", "--admin-token-file", str(token)]
        runners: list[subprocess.Popen[bytes]] = []
        try:
            submitted = fedlink_cli(
                fedlink,
                "job",
                "submit",
                str(job_file(work, args.devices, args.rounds)),
                connection=connection,
            )
            job_id = submitted.strip().splitlines()[-1]
            if not args.json:
                print(f"coordinator on {address}; job {job_id}; {args.devices} devices with {sizes} samples")
            runners = start_runners(fedlink, address, work, args.devices, args.alpha, args.seed)
            watch(fedlink, job_id, connection)
            per_round = []
            for round_no in range(1, args.rounds + 1):
                acc = accuracy(download(fedlink, job_id, round_no, work, connection), x_test, y_test)
                per_round.append(acc)
                if not args.json:
                    print(f"round {round_no:2d}: held-out accuracy {acc:.4f}")
            final = accuracy(download(fedlink, job_id, 0, work, connection), x_test, y_test)
        finally:
            for process in runners:
                try:
                    process.wait(timeout=30)  # the session is over: each runner leaves by itself
                except subprocess.TimeoutExpired:
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=30)
                if process.returncode != 0:
                    print(f"a runner exited with status {process.returncode}", file=sys.stderr)
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(timeout=30)
        if args.json:
            summary = {"per_round": per_round, "final": final, "partition_sizes": sizes, "job_id": job_id}
            print(json.dumps(summary))
        else:
            print(f"final global model: held-out accuracy {final:.4f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
