"""Flower 1.42's run_simulation on the simulation benchmark's FedAvg workload: wall time and peak memory.

Flower runs in its own cached venv (``bench/.cache/flower-venv``: it pins protobuf < 7 and its own Ray,
which fedlink's venv cannot hold), one configuration per fresh subprocess running
``bench/flower_app/run_config.py``. Standard library only (``bench.orphans`` is too), so any Python can
import ``run_flower``.

What is measured:

* ``wall_s``: inside the subprocess, from the ``run_simulation`` call to its return; Flower, Ray and
  numpy are imported before. It includes Ray starting and stopping, as Flower's users experience it.
* ``peak_rss_mb``: this process samples, every 100 ms, the subprocess (Flower's driver) and every
  process marked as the run's (an environment tag, or the run's scratch folder as working directory) or
  descending from one: Ray's GCS, raylet, agents, the ClientApp actors and other workers, even when
  re-parented. Each sample is the driver's VmHWM plus the VmRSS of
  every other such process; the figure is the largest sample. Pages shared between processes (Ray's
  object store in /dev/shm, shared libraries) are counted once per process that maps them.
* ``peak_pss_mb``: the largest sum of Pss (``/proc/PID/smaps_rollup``) over the same processes at one
  sample, driver included, read every 2 s (costly for big processes): shared pages are divided among
  their users, so counted once.
* ``driver_hwm_mb``: the driver's own VmHWM at its end, exact.

Flower's telemetry is turned off (``FLWR_TELEMETRY_ENABLED=0``): it would wait on a network the
benchmark machine may not reach. Ray is started with ``address="local"`` so a ``ray start`` cluster
elsewhere on the machine is never joined.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".cache" / "flower-venv"
WORKER = ROOT / "bench" / "flower_app" / "run_config.py"
TARGET_VERSION = (1, 42)
RESULT_MARKER = "FLOWER_BASELINE_RESULT "
TAG_VARIABLE = "FEDLINK_FLOWER_BASELINE_TAG"
SAMPLE_INTERVAL_S = 0.1
PSS_EVERY = 20
_REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "devices": int,
    "floats": int,
    "rounds": int,
    "wall_s": (int, float),
    "ok": bool,
    "flower_version": str,
}


class BaselineError(Exception):
    """The Flower baseline could not be set up or its output could not be read."""


@dataclass(frozen=True, slots=True)
class FlowerEnv:
    """The Flower venv's interpreter and the Flower version installed in it."""

    python: Path
    version: str


@dataclass(slots=True)
class TreeMemory:
    """Peaks of the sampled process tree (see the module docstring for what each counts)."""

    peak_rss_bytes: int = 0
    peak_pss_bytes: int = 0
    max_processes: int = 0
    samples: int = 0
    names: set[str] = field(default_factory=set)


# ---------------------------------------------------------------- the venv


def nearest_version(available: Sequence[str], target: tuple[int, int] = TARGET_VERSION) -> str:
    """The newest release of ``target``'s minor series, else the nearest minor (older preferred on ties).

    Raises:
        BaselineError: no version number could be read.
    """
    parsed: list[tuple[tuple[int, ...], str]] = []
    for text in available:
        if re.fullmatch(r"\d+(\.\d+)*", text.strip()):
            parsed.append((tuple(int(p) for p in text.strip().split(".")), text.strip()))
    if not parsed:
        raise BaselineError(f"no Flower release among {list(available)!r}")

    def distance(item: tuple[tuple[int, ...], str]) -> tuple[int, int, tuple[int, ...]]:
        major_minor = (item[0] + (0, 0))[:2]
        gap = abs((major_minor[0] - target[0]) * 1000 + major_minor[1] - target[1])
        newer = 1 if major_minor > target else 0
        return (gap, newer, tuple(-p for p in item[0]))

    return min(parsed, key=distance)[1]


def _installed_flower(python: Path) -> str | None:
    if not python.exists():
        return None
    done = subprocess.run(
        tied([str(python), "-c", "import flwr, ray; print(flwr.__version__)"]),
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        tied([str(python), "-m", "pip", *args]),
        capture_output=True,
        text=True,
        check=False,
    )


def _loud(message: str) -> None:
    bar = "!" * 100
    print(f"{bar}\n!! {message}\n{bar}", file=sys.stderr, flush=True)


def ensure_flower_venv(venv: Path = VENV) -> FlowerEnv:
    """Creates the Flower venv on first use (python3.11 -m venv; pip install flwr[simulation]==1.42.*).

    Later calls reuse it when it holds a 1.42 release. If 1.42 cannot be installed, the nearest release
    is installed instead and a loud warning says so.

    Raises:
        BaselineError: the venv could not be created or Flower not installed.
    """
    python = venv / "bin" / "python"
    wanted = f"{TARGET_VERSION[0]}.{TARGET_VERSION[1]}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Two benchmarks starting at once must not build the same venv twice.
    with open(venv.parent / "flower-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        version = _installed_flower(python)
        if version is not None and version.startswith(wanted + "."):
            return FlowerEnv(python=python, version=version)
        if not python.exists():
            print(f"creating {venv} (first use; takes a minute)", file=sys.stderr, flush=True)
            made = subprocess.run(
                tied(["python3.11", "-m", "venv", str(venv)]),
                capture_output=True,
                text=True,
                check=False,
            )
            if made.returncode != 0:
                raise BaselineError(f"python3.11 -m venv {venv} failed: {made.stderr.strip()}")
        installed = _pip(python, "install", "--quiet", f"flwr[simulation]=={wanted}.*")
        if installed.returncode != 0:
            listed = _pip(python, "index", "versions", "flwr")
            found = re.search(r"Available versions:\s*(.+)", listed.stdout)
            if found is None:
                raise BaselineError(f"cannot install flwr {wanted}: {installed.stderr.strip()[-2000:]}")
            fallback = nearest_version(found.group(1).split(","))
            _loud(f"Flower {wanted} is not installable here; using flwr {fallback} INSTEAD")
            installed = _pip(python, "install", "--quiet", f"flwr[simulation]=={fallback}")
            if installed.returncode != 0:
                raise BaselineError(f"cannot install flwr {fallback}: {installed.stderr.strip()[-2000:]}")
        version = _installed_flower(python)
        if version is None:
            raise BaselineError(f"flwr does not import in {venv} after installing it")
        if not version.startswith(wanted + "."):
            _loud(f"the Flower baseline runs flwr {version}, NOT {wanted}")
        return FlowerEnv(python=python, version=version)


# ---------------------------------------------------------------- memory of the process tree


def _status_kb(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            values[key] = int(rest.split()[0])
    return values


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


class ProcessTree:
    """The processes of one run: the root, processes marked as the run's, and their descendants.

    A process is marked by the run's tag in its environment or by the run's scratch folder as its
    working directory. Both are needed: Ray's agents daemonize (re-parented away from the driver) and
    overwrite their environment block with their process title, but keep the driver's working directory.
    """

    def __init__(self, root: int, tag: str, workdir: Path | None = None) -> None:
        self.root = root
        self._tag = f"{TAG_VARIABLE}={tag}".encode()
        self._workdir = str(workdir) if workdir is not None else None
        self._marked: set[tuple[int, str]] = set()  # (pid, start time): pids are reused
        self._env_read: set[tuple[int, str]] = set()

    def members(self) -> dict[int, str]:
        """The live members now, pid → command name."""
        parents: dict[int, int] = {}
        names: dict[int, str] = {}
        starts: dict[int, str] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                # The command name may hold spaces and parentheses: the fields follow the last ')'.
                rest = stat[stat.rindex(")") + 2 :].split()
                if rest[0] == "Z":
                    continue  # a zombie holds no memory and cannot be killed; its parent reaps it
                parents[pid], starts[pid] = int(rest[1]), rest[19]
                names[pid] = stat[stat.index("(") + 1 : stat.rindex(")")]
        found = {pid for pid in parents if pid == self.root or self._is_marked(pid, starts[pid])}
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        return {pid: names[pid] for pid in found if pid in names}

    def _is_marked(self, pid: int, start: str) -> bool:
        key = (pid, start)
        if key in self._marked:
            return True
        try:
            if key not in self._env_read:
                # Read once: a process's initial environment does not change.
                self._env_read.add(key)
                if self._tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    self._marked.add(key)
                    return True
            if self._workdir is not None and os.readlink(f"/proc/{pid}/cwd") == self._workdir:
                self._marked.add(key)
                return True
        except OSError:
            pass  # gone, or not ours to read: not part of the run
        return False


def sample_tree(tree: ProcessTree, memory: TreeMemory, with_pss: bool = True) -> dict[int, str]:
    """Takes one sample of the tree into ``memory`` (Pss too if ``with_pss``); returns the members seen."""
    members = tree.members()
    rss_kb = pss_kb = 0
    for pid, name in members.items():
        with contextlib.suppress(OSError, KeyError, ValueError):
            status = _status_kb(pid, ("VmRSS", "VmHWM"))
            # The driver's exact peak; the others' current size (a sum of peaks would add up
            # moments that never coincided).
            rss_kb += status["VmHWM"] if pid == tree.root else status["VmRSS"]
            if with_pss:
                pss_kb += _pss_kb(pid)
            memory.names.add(name)
    memory.peak_rss_bytes = max(memory.peak_rss_bytes, rss_kb * 1024)
    memory.peak_pss_bytes = max(memory.peak_pss_bytes, pss_kb * 1024)
    memory.max_processes = max(memory.max_processes, len(members))
    memory.samples += 1
    return members


# ---------------------------------------------------------------- one configuration


def parse_result(stdout: str) -> dict[str, Any]:
    """The worker's result record: the last ``FLOWER_BASELINE_RESULT {json}`` line, checked.

    Raises:
        BaselineError: no result line, bad JSON, or a field missing or of the wrong type.
    """
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise BaselineError("the Flower run printed no result line")
    try:
        record = json.loads(lines[-1][len(RESULT_MARKER) :])
    except json.JSONDecodeError as exc:
        raise BaselineError(f"unreadable result line: {exc}") from exc
    if not isinstance(record, dict):
        raise BaselineError(f"the result is not an object: {record!r}")
    for name, kind in _REQUIRED_FIELDS.items():
        value = record.get(name)
        # bool is an int: keep true/false out of the numeric fields.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise BaselineError(f"result field {name!r} is {value!r}, not {kind}")
    if record["ok"] and not (math.isfinite(record["wall_s"]) and record["wall_s"] > 0):
        raise BaselineError(f"a successful run with wall time {record['wall_s']!r}")
    return record


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's OOM killer?)" if name == "SIGKILL" else ""
        return f"the Flower process died of {name}{hint}"
    return f"the Flower process exited with status {returncode}"


def _kill(pids: Iterator[int] | Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stop_run(process: subprocess.Popen[bytes], tree: ProcessTree, grace_s: float) -> int:
    """Waits ``grace_s`` for the run's processes to end, then kills what is left; returns how many."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process.poll() is not None and not tree.members():
            return 0
        time.sleep(SAMPLE_INTERVAL_S)
    left = tree.members()
    _kill(sorted(left))
    process.wait()
    return len(left)


def _tail(path: Path, chars: int = 1500) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:].strip()


def run_flower(
    devices: int, floats: int, rounds: int, timeout_s: float, client_cpus: float | None = None
) -> dict[str, Any]:
    """Runs one configuration of the workload on Flower in a fresh subprocess and measures it.

    Args:
        devices: virtual devices (Flower's num_supernodes), all of them in every round.
        floats: float32 values in the model, one array.
        rounds: FedAvg rounds.
        timeout_s: the subprocess and its Ray processes are killed after this long.
        client_cpus: Flower's ``client_resources["num_cpus"]``; None keeps Flower's default (2).

    Returns:
        ``{devices, floats, rounds, wall_s, peak_rss_mb, ok, flower_version, error?}`` plus
        ``peak_pss_mb``, ``driver_hwm_mb``, ``max_processes``, ``max_abs_error`` and others. A failure
        (timeout, OOM, wrong model) is a record with ``ok`` false and ``error`` saying why.

    Raises:
        BaselineError: the Flower venv cannot be set up.
    """
    env = ensure_flower_venv()
    tag = uuid.uuid4().hex
    child_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    child_env |= {"FLWR_TELEMETRY_ENABLED": "0", TAG_VARIABLE: tag, "PYTHONUNBUFFERED": "1"}
    command = [
        str(env.python),
        str(WORKER),
        f"--devices={devices}",
        f"--floats={floats}",
        f"--rounds={rounds}",
    ]
    if client_cpus is not None:
        command.append(f"--client-cpus={client_cpus}")
    memory = TreeMemory()
    # Figures from a busy machine are not comparable to a quiet one's: keep the load with them.
    load_before, sampler_cpu_before = os.getloadavg()[0], time.process_time()
    with tempfile.TemporaryDirectory(prefix="flower-baseline-") as scratch:
        out_path, err_path = Path(scratch) / "stdout", Path(scratch) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            # Tied to this process; the Ray processes it starts share its fate (Ray sees to that).
            process = subprocess.Popen(tied(command), stdout=out, stderr=err, env=child_env, cwd=scratch)
        tree = ProcessTree(process.pid, tag, workdir=Path(scratch).resolve())
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while process.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                break
            # Pss walks page tables: 65 ms of CPU for a 7 GB driver. Every 20th sample (2 s) keeps the
            # sampler from stealing a core Flower needs; RSS comes from the cheap status file each time.
            sample_tree(tree, memory, with_pss=memory.samples % PSS_EVERY == 0)
            time.sleep(SAMPLE_INTERVAL_S)
        leftovers = _stop_run(process, tree, grace_s=0.0 if timed_out else 10.0)
        stdout, stderr_tail = out_path.read_text(errors="replace"), _tail(err_path)
    record: dict[str, Any] = {
        "devices": devices,
        "floats": floats,
        "rounds": rounds,
        "wall_s": None,
        "ok": False,
        "flower_version": env.version,
    }
    if timed_out:
        record["error"] = f"timed out after {timeout_s:g} s"
    else:
        try:
            record |= parse_result(stdout)
        except BaselineError as exc:
            record["error"] = f"{_describe_exit(process.returncode)}; {exc}; stderr: {stderr_tail}"
    if record.get("error") is None:
        record.pop("error", None)
    record |= {
        "peak_rss_mb": round(memory.peak_rss_bytes / 2**20, 1),
        "peak_pss_mb": round(memory.peak_pss_bytes / 2**20, 1),
        "max_processes": memory.max_processes,
        "memory_samples": memory.samples,
        "process_names": sorted(memory.names),
        "leftover_processes_killed": leftovers,
        "load_avg_1m_before": load_before,
        "sampler_cpu_s": round(time.process_time() - sampler_cpu_before, 2),
    }
    return record


# ---------------------------------------------------------------- the grid


def parse_sizes(text: str) -> list[int]:
    """``"10,100,1_000"`` → ``[10, 100, 1000]``.

    Raises:
        argparse.ArgumentTypeError: a part is not a positive integer.
    """
    sizes: list[int] = []
    for part in text.split(","):
        try:
            size = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer") from None
        if size <= 0:
            raise argparse.ArgumentTypeError(f"{size} is not positive")
        sizes.append(size)
    return sizes


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the records, one line per configuration."""
    header = f"{'devices':>8} {'floats':>10} {'rounds':>6} {'wall s':>8} "
    header += f"{'peak RSS MB':>12} {'peak PSS MB':>12}  ok"
    lines = [header, "-" * len(header)]
    for r in records:
        wall = f"{r['wall_s']:.2f}" if isinstance(r.get("wall_s"), int | float) else "-"
        status = "yes" if r["ok"] else f"NO: {r.get('error', '?')[:120]}"
        lines.append(
            f"{r['devices']:>8} {r['floats']:>10} {r['rounds']:>6} {wall:>8} "
            f"{r.get('peak_rss_mb', 0):>12.1f} {r.get('peak_pss_mb', 0):>12.1f}  {status}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the grid, one fresh subprocess per configuration, smallest first; prints the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=parse_sizes, default=[10, 100, 1000])
    parser.add_argument("--floats", type=parse_sizes, default=[10_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--client-cpus", type=float, default=None, help="default: Flower's own (2)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here as a JSON list")
    args = parser.parse_args(argv)
    env = ensure_flower_venv()
    print(f"Flower {env.version} in {env.python.parent.parent}", flush=True)
    records: list[dict[str, Any]] = []
    for floats in args.floats:
        for devices in args.devices:
            record = run_flower(devices, floats, args.rounds, args.timeout, args.client_cpus)
            records.append(record)
            print(json.dumps(record), flush=True)
            if args.json is not None:
                # Written after every configuration: a long grid killed half-way keeps what it measured.
                args.json.write_text(json.dumps(records, indent=2) + "\n")
    print(format_table(records))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
