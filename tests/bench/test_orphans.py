"""bench.orphans: a child started through it dies when its parent is SIGKILLed; one started without it
lives on (what the helper is for); the reaper ends the processes a command starts of its own; and every
process that bench/ and tests/ start goes through it.

Each test starts an intermediate process (itself tied to the test) that starts the children, kills the
intermediate with SIGKILL, as a timeout does, and polls /proc for the children.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import orphans

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]
#: Far beyond what the kernel takes to deliver the signal, even on a loaded machine.
GONE_WITHIN_S = 10.0

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def python(code: str) -> list[str]:
    """``python -c CODE`` that can import ``bench``."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(code)]


def wait_gone(pid: int, what: str, within: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while orphans.alive(pid):
        assert time.monotonic() < deadline, f"{what} (pid {pid}) runs {within:g} s after its parent died"
        time.sleep(0.02)


@contextlib.contextmanager
def intermediate(code: str) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """Starts ``code``, which prints the pids of the children it started on its first line, then sleeps.

    Yields the process and those pids; every one of them still running at the end is killed.
    """
    process = subprocess.Popen(orphans.tied(python(code)), stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # blocks until the children run (or the process failed)
        assert line, f"the intermediate process exited with {process.wait()} before starting its children"
        pids = [int(pid) for pid in line.split()]
        yield process, pids
    finally:
        for pid in [process.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def sigkill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL


def test_a_tied_child_dies_with_its_sigkilled_parent_and_an_untied_one_does_not() -> None:
    code = f"""
        import subprocess, time
        from bench.orphans import dies_with_parent, tied
        tied = subprocess.Popen(tied({SLEEPER!r}))
        by_preexec = subprocess.Popen({SLEEPER!r}, preexec_fn=dies_with_parent())
        untied = subprocess.Popen({SLEEPER!r})
        print(tied.pid, by_preexec.pid, untied.pid, flush=True)
        time.sleep(300)
    """
    with intermediate(code) as (process, (tied, by_preexec, untied)):
        sigkill(process)
        wait_gone(tied, "the tied child")
        wait_gone(by_preexec, "the child tied by its preexec_fn")
        # Without the helper, the orphan goes on: the test above would notice a helper that did nothing.
        time.sleep(0.5)
        assert orphans.alive(untied), "the untied child died too: this test proves nothing"


async def test_a_child_of_asyncio_dies_with_its_sigkilled_parent() -> None:
    code = f"""
        import asyncio, time
        from bench.orphans import tied

        async def main():
            child = await asyncio.create_subprocess_exec(*tied({SLEEPER!r}))
            print(child.pid, flush=True)
            time.sleep(300)

        asyncio.run(main())
    """
    with intermediate(code) as (process, (child,)):
        sigkill(process)
        wait_gone(child, "the asyncio child")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_multiprocessing_child_dies_with_its_sigkilled_parent(tmp_path: Path, method: str) -> None:
    # The target must be importable by the child: a module of its own.
    (tmp_path / "tied_target.py").write_text(
        textwrap.dedent("""
            import sys, time
            from pathlib import Path
            from bench.orphans import die_with_multiprocessing_parent

            def main(ready: str) -> None:
                die_with_multiprocessing_parent()
                Path(ready).touch()
                time.sleep(300)
        """)
    )
    ready = tmp_path / "ready"
    code = f"""
        import multiprocessing, time
        sys.path.insert(0, {str(tmp_path)!r})
        import tied_target
        if __name__ == "__main__":
            context = multiprocessing.get_context({method!r})
            child = context.Process(target=tied_target.main, args=({str(ready)!r},))
            child.start()
            print(child.pid, flush=True)
            time.sleep(300)
    """
    with intermediate(code) as (process, (child,)):
        deadline = time.monotonic() + 60
        while not ready.exists():  # the child has asked for the signal
            assert orphans.alive(child), "the multiprocessing child died before it was ready"
            assert time.monotonic() < deadline, "the multiprocessing child never got ready"
            time.sleep(0.02)
        sigkill(process)
        wait_gone(child, f"the {method} child")


def test_a_child_whose_parent_died_before_it_asked_exits_at_once() -> None:
    # Pid 1 is nobody's parent here: the child must see it is not its parent's and exit, not run on.
    code = "from bench.orphans import die_with; die_with(1); print('ran on')"
    done = subprocess.run(orphans.tied(python(code)), capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr


def test_a_tied_command_keeps_its_pid_status_and_output_and_a_missing_one_is_127() -> None:
    code = "import os, sys; print(os.getpid(), flush=True); sys.exit(7)"
    process = subprocess.Popen(orphans.tied([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=60)
    assert (process.returncode, out.strip()) == (7, str(process.pid))  # exec'd in place
    done = subprocess.run(orphans.tied(["no-such-command-here"]), capture_output=True, text=True, timeout=60)
    assert done.returncode == 127 and "cannot run no-such-command-here" in done.stderr


def test_the_reaper_ends_the_processes_a_command_started_when_the_reapers_parent_dies() -> None:
    command = python(f"""
        import subprocess, time
        grandchild = subprocess.Popen({SLEEPER!r})  # not tied: the reaper must end it
        print(grandchild.pid, flush=True)
        time.sleep(300)
    """)
    code = f"""
        import subprocess, time
        from bench.orphans import reaped
        reaper = subprocess.Popen(reaped({command!r}), stdout=subprocess.PIPE, text=True)
        print(reaper.pid, reaper.stdout.readline().strip(), flush=True)
        time.sleep(300)
    """
    with intermediate(code) as (process, (reaper, grandchild)):
        assert orphans.alive(grandchild)
        sigkill(process)
        wait_gone(grandchild, "the command's own child")
        wait_gone(reaper, "the reaper")


def test_the_reaper_returns_the_commands_status_and_ends_what_it_left_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "left-behind.pid"
    command = python(f"""
        import subprocess, sys
        from pathlib import Path
        Path({str(pid_file)!r}).write_text(str(subprocess.Popen({SLEEPER!r}).pid))
        sys.exit(3)
    """)
    done = subprocess.run(orphans.reaped(command, grace_s=1), timeout=60)
    assert done.returncode == 3
    left_behind = int(pid_file.read_text())
    try:
        assert not orphans.alive(left_behind), "the reaper exited and left the command's child running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(left_behind, signal.SIGKILL)


# ---------------------------------------------------------------- the rule, kept

#: Calls that start a process, by module and name.
STARTERS = {
    ("subprocess", "Popen"),
    ("subprocess", "run"),
    ("subprocess", "call"),
    ("subprocess", "check_call"),
    ("subprocess", "check_output"),
    ("asyncio", "create_subprocess_exec"),
    ("asyncio", "create_subprocess_shell"),
}
#: What a started command must go through.
WRAPPERS = {"tied", "reaped"}
#: Files left out, each with the reason.
NOT_YET_TIED = {
    "tests/cli/server/test_serve_files.py": "its Popen and run calls wait for their owner's change",
    "bench/orphans.py": "the reaper ties its command with a preexec_fn (safe there: it runs no threads)",
}


def _wraps(value: ast.expr) -> bool:
    """Whether ``value`` is a call of ``tied``/``reaped`` (plain or as ``orphans.`` ones)."""
    if not isinstance(value, ast.Call):
        return False
    function = value.func
    name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")
    return name in WRAPPERS


def _wrapped(argument: ast.expr, wrapped_names: set[str]) -> bool:
    """Whether a started command is wrapped, directly or through a name assigned a wrapped one."""
    value = argument.value if isinstance(argument, ast.Starred) else argument
    return _wraps(value) or (isinstance(value, ast.Name) and value.id in wrapped_names)


def test_every_process_that_bench_and_tests_start_is_tied_to_its_parent() -> None:
    untied: list[str] = []
    for path in sorted(p for folder in ("bench", "tests") for p in (ROOT / folder).rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name in NOT_YET_TIED:
            continue
        source = path.read_text()
        tree = ast.parse(source)
        wrapped_names = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and _wraps(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in STARTERS
                and not (node.args and _wrapped(node.args[0], wrapped_names))
            ):
                untied.append(f"{name}:{node.lineno}: {ast.unparse(node.func)}() of a command not tied()")
        # A multiprocessing child ties itself, first thing in its target.
        spawns = "multiprocessing" in source and re.search(r"\.Process\(", source)
        if spawns and "die_with_multiprocessing_parent()" not in source:
            untied.append(
                f"{name}: starts multiprocessing children that do not die_with_multiprocessing_parent()"
            )
    listed = "\n".join(untied)
    assert not untied, f"processes that would outlive a killed parent (see bench/orphans.py):\n{listed}"
