"""Child processes that die with their parent, even a parent killed by SIGKILL (Linux).

A benchmark or a test that times out is killed outright (``subprocess.run``'s timeout, pytest-timeout,
CI), and its children used to live on: the store benchmark's eight workers went on claiming tasks in
PostgreSQL for 43 minutes after their parent was gone. Every process that ``bench/`` and ``tests/``
start asks the kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``), here:

- ``subprocess.Popen(tied(command), ...)`` (``run``, ``asyncio.create_subprocess_exec(*tied(...))``):
  the command starts through this module, which asks for the signal and then execs the command (same
  pid, same file descriptors and environment);
- :func:`die_with_multiprocessing_parent` first thing in a ``multiprocessing`` child's target (a fork
  server's child watches its parent from a thread instead);
- ``subprocess.Popen(reaped(command), ...)`` for a command that starts processes of its own that we
  cannot tie (an example script, ``ray start``): this module runs it as a subreaper and ends everything
  it started when it exits, or when the caller dies. Stop it with SIGTERM, never SIGKILL.

Not a ``preexec_fn``: one makes ``subprocess`` fork() instead of vfork(), which runs gRPC's fork
handlers in a parent that has gRPC threads (a test's in-process coordinator, a benchmark's clients), and
those crashed the child now and then (``epoll_wait error: Bad file descriptor``, then SIGABRT).

The kernel sends the signal when the *thread* that started the child exits, not only the process: start
children from a thread that lives as long as they should (the main thread, an event loop's thread).
Elsewhere than on Linux the children are not tied. Standard library only, so that it runs as a script.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

# Imported where used: the exec wrapper (main) starts in front of every process the tests start.
if TYPE_CHECKING:
    import subprocess

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SCRIPT = os.path.realpath(__file__)


def _load_prctl() -> Callable[[int, int], int] | None:
    if sys.platform != "linux":
        return None
    function = ctypes.CDLL(None, use_errno=True).prctl
    function.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    function.restype = ctypes.c_int

    def prctl(option: int, value: int) -> int:
        result: int = function(option, value, 0, 0, 0)
        return result

    return prctl


_prctl = _load_prctl()


def _set(option: int, value: int) -> None:
    if _prctl is not None and _prctl(option, value) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


def tied(command: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """``command`` started through this module, so that it gets ``sig`` when the calling thread of this
    process ends; for ``subprocess`` and ``asyncio.create_subprocess_exec``.

    Args:
        command: the program and its arguments (looked up on PATH, as ``subprocess`` does).
        sig: SIGKILL (the default) for a process that has nothing to clean up; SIGTERM for one that
            must stop what it started itself.
    """
    return [*_through_this_module(sig), "--", *command]


def reaped(command: Sequence[str], grace_s: float = 5.0) -> list[str]:
    """``command`` run by this module as a subreaper (:func:`reap`), itself tied to this process (it gets
    SIGTERM when the calling thread ends, and then ends the command's whole tree)."""
    return [*_through_this_module(signal.SIGTERM), "--reap", "--grace", f"{grace_s:g}", "--", *command]


def _through_this_module(sig: int) -> list[str]:
    # -I -S: this module needs the standard library only; a bare interpreter starts in milliseconds.
    return [sys.executable, "-I", "-S", _SCRIPT, "--parent", str(os.getpid()), "--signal", str(int(sig))]


def die_with(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child process: has the kernel send ``sig`` when ``parent`` dies; exits at once if it has.

    Args:
        parent: the pid of the process that started this one, taken there before the fork: once the
            parent is dead, ``os.getppid()`` names whoever adopted the child instead, so a child that
            only asked its own ``os.getppid()`` would miss a parent that died before the call.
        sig: the signal.
    """
    _set(_PR_SET_PDEATHSIG, sig)
    if _prctl is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before the request: the kernel will never send the signal


def dies_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` (:func:`die_with`), for a parent without gRPC (see the module's note): prefer
    :func:`tied`, which is safe in any parent."""
    return functools.partial(die_with, os.getpid(), sig)


def die_with_multiprocessing_parent(sig: int = signal.SIGKILL) -> None:
    """First thing in a ``multiprocessing`` child's target: the child gets ``sig`` when the process that
    started it dies.

    A spawned or forked child asks the kernel (:func:`die_with`). A fork server's child cannot: the fork
    server, its real parent, lives as long as any of its children holds the pipe that keeps it alive,
    and each of them does; a thread of the child waits for the parent's end instead.
    """
    import multiprocessing  # here: the exec wrapper (main) has no use for it

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        raise RuntimeError("die_with_multiprocessing_parent() is for multiprocessing children")
    if os.getppid() == parent.pid:
        die_with(parent.pid, sig)
    else:  # a fork server's child, or one whose parent has already died (and was adopted)
        _watch(parent.pid, sig)


def _watch(pid: int, sig: int) -> None:
    """Sends ``sig`` to this process, from a daemon thread, once process ``pid`` has ended."""
    import select
    import threading

    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except OSError:  # a kernel without pidfds (before 5.3): poll
        handle = None

    def wait() -> None:
        if handle is not None:
            select.select([handle], [], [])  # readable once the process has exited
        else:
            while alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait, name=f"die-with-{pid}", daemon=True).start()


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but not reaped, has)."""
    try:
        stat = _read(f"/proc/{pid}/stat")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: only whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    # The state is the field after the command name, which may hold spaces and parentheses.
    return stat[stat.rindex(")") + 2] not in "ZX"


# ---------------------------------------------------------------- the reaper: a command and all it starts


class _Stop(Exception):
    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.sig = sig


def _raise_stop(sig: int, frame: FrameType | None) -> None:
    raise _Stop(sig)


def _descendants() -> list[int]:
    """This process's living descendants (as a subreaper, orphans of its tree are still its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = _read(os.path.join(entry.path, "stat"))
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] not in "ZX":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap_exited() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_all(command: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """Ends the command (SIGTERM) and then what is left of its tree (SIGTERM, then SIGKILL once
    ``grace_s`` has passed); reaps them all."""
    import subprocess

    deadline = time.monotonic() + grace_s
    if command is not None and command.poll() is None:
        command.terminate()  # first, so that it may stop what it started in its own order
        with contextlib.suppress(subprocess.TimeoutExpired):
            command.wait(timeout=grace_s)
    sig = signal.SIGTERM
    while pids := _descendants():
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(0.05)
        _reap_exited()
    _reap_exited()


def reap(command: Sequence[str], grace_s: float) -> int:
    """Runs ``command`` as a subreaper and returns its exit status (128 + N for a signal N).

    When the command exits, every process it left behind (wherever in its tree) is ended: SIGTERM, then
    SIGKILL after ``grace_s``. On SIGTERM, SIGINT or SIGHUP (the kernel's, when the caller of
    :func:`reaped` dies) the command gets SIGTERM and ``grace_s`` to exit, then what is left of its tree
    is ended the same way.
    """
    import subprocess

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    _set(_PR_SET_CHILD_SUBREAPER, 1)
    status = 128 + signal.SIGTERM
    child: subprocess.Popen[bytes] | None = None
    try:
        # A preexec_fn is safe here: this process runs no threads.
        child = subprocess.Popen(command, preexec_fn=dies_with_parent())
        code = child.wait()
        status = code if code >= 0 else 128 - code
    except _Stop as stop:
        status = 128 + stop.sig
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # ending the tree is not to be interrupted
        _end_all(child, grace_s)
    return status


USAGE = "usage: orphans.py --parent PID [--signal N] [--reap [--grace SECONDS]] -- COMMAND [ARG...]"


def main(argv: Sequence[str] | None = None) -> int:
    """What :func:`tied` and :func:`reaped` run (``USAGE``): ties this process to ``--parent``, then
    execs the command (or, with ``--reap``, runs it as a subreaper, :func:`reap`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    options: dict[str, str] = {"--signal": str(int(signal.SIGKILL)), "--grace": "5"}
    reaper = False
    try:
        while args[0] != "--":  # parsed by hand: argparse alone takes longer to import than the rest
            option = args.pop(0)
            if option == "--reap":
                reaper = True
            elif option in ("--parent", "--signal", "--grace"):
                options[option] = args.pop(0)
            else:
                raise ValueError(option)
        command = args[1:]
        parent, sig, grace_s = int(options["--parent"]), int(options["--signal"]), float(options["--grace"])
    except (IndexError, KeyError, ValueError):
        command = []
    if not command:
        print(USAGE, file=sys.stderr)
        return 2
    if reaper:
        # The tie's signal must reach the handler that ends the tree: set before the tie can fire.
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(stop, _raise_stop)
        try:
            die_with(parent, sig)
        except _Stop:
            return 128 + signal.SIGTERM
        return reap(command, grace_s)
    die_with(parent, sig)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        print(f"orphans.py: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        return 127 if isinstance(error, FileNotFoundError) else 126
    return 0  # not reached: execvp replaced this process


if __name__ == "__main__":
    raise SystemExit(main())
