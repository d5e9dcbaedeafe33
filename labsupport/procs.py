"""Child processes that end when their parent does, however the parent ends.

A notebook starts servers as processes: chapter 07's workers and routers, chapter 08's ``vllm serve``,
the course table's and the capstone's servers. Each runs in a session of its own
(``start_new_session``), so the kernel's interrupt (the stop button) does not reach it and ``killpg``
reaches its own children. But then nothing tells it when the kernel goes: after Kernel > Restart
(which kills a kernel that does not shut down in time), a crash or ``kill -9``, chapter 07's five
processes were reparented to PID 1 and kept their ports and memory, and every re-run added a set.

One mechanism for each way a parent can go:

* **SIGKILL, a crash**: ``die_with_parent()``, which a child calls first thing. On Linux the kernel
  itself sends the child SIGTERM the moment its parent exits (``prctl(PR_SET_PDEATHSIG)``); everywhere
  a daemon thread also checks twice a second that the parent is still there (an orphan's parent pid
  changes), which is how macOS learns it, and SIGKILLs the process if SIGTERM did not end it in time.
* **Commands we did not write** (``vllm serve``): ``popen(cmd, ...)``, a ``subprocess.Popen`` that runs
  the command through a launcher (this file run as a script: ``_launch``). On Linux the launcher sets
  the death signal and ``exec``s the command, so the process *is* the command: same pid, its own
  signal handling, nothing in between. Where there is no ``prctl`` it stays as a small supervisor that
  watches the parent, passes SIGTERM/SIGINT on, and stops the command's process group.
* **A normal exit** (Kernel > Shutdown, the end of a script): every process ``popen`` started and that
  still runs is stopped at exit (``stop_children``: SIGTERM, a few seconds, then SIGKILL to its group).
  ``run(cmd, ...)`` is ``subprocess.run`` over ``popen``.

Linux's death signal comes when the *thread* that forked the child ends, not its process: a child
started from a worker thread that then finishes would get it at once. So ``popen`` forks from the main
thread, or from one spawner thread that lives as long as the process. Whoever calls
``die_with_parent()`` in a child it started itself should start it from such a thread too.

Set ``LABSUPPORT_NO_PDEATHSIG=1`` to behave as on a system without ``prctl`` (the tests do, to check the
fallbacks on Linux).
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5  # how often the fallbacks look at the parent
GRACE_S = 10.0  # after the parent is gone: how long SIGTERM may take before SIGKILL
STOP_TIMEOUT_S = 3.0  # at exit: how long children may take to stop on SIGTERM (Jupyter waits ~5 s for a kernel)

_children: set[subprocess.Popen] = set()
_lock = threading.Lock()
_spawner = None  # the long-lived thread's executor, made on first use from another thread


def _death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (thread) exits; False where it cannot."""
    if not sys.platform.startswith("linux") or os.environ.get("LABSUPPORT_NO_PDEATHSIG") == "1":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """End this process when its parent exits: ``sig`` at once on Linux (the kernel sends it), and from a
    watcher thread everywhere within ``POLL_S``; SIGKILL if ``sig`` has not ended it ``GRACE_S`` later.

    Call it first thing in a child. ``parent_pid``: the parent the child expects (default: the current
    one); if that one is already gone, the signal comes at once. Returns whether the kernel's death
    signal is set (False: only the watcher)."""
    parent = parent_pid or os.getppid()
    kernel_sends = _death_signal(sig)
    if os.getppid() != parent:  # the parent went before the signal was set
        os.kill(os.getpid(), sig)

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        if not kernel_sends:
            os.kill(os.getpid(), sig)
        time.sleep(GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="labsupport-parent-watch", daemon=True).start()
    return kernel_sends


def from_long_lived_thread(fn):
    """``fn()`` on the main thread or on the spawner thread (see the module's docstring for why)."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _lock:
        if _spawner is None:
            from concurrent.futures import ThreadPoolExecutor
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="labsupport-spawner")  # its thread never retires
    return _spawner.submit(fn).result()


def launcher(cmd: list[str]) -> list[str]:
    """``cmd`` prefixed with the launcher, for this process as the parent."""
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), "--", *map(str, cmd)]


def popen(cmd, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` for a child that ends when this process ends (see above).

    ``cmd`` must be a list; a missing executable raises FileNotFoundError here, as Popen would.
    ``proc.args`` is ``cmd``; the process runs the launcher's command line."""
    cmd = [str(c) for c in cmd]
    if (os.sep not in cmd[0] and shutil.which(cmd[0], path=(kwargs.get("env") or os.environ).get("PATH")) is None) \
            or (os.sep in cmd[0] and not os.access(cmd[0], os.X_OK)):
        raise FileNotFoundError(f"no such command: {cmd[0]}")
    proc = from_long_lived_thread(lambda: subprocess.Popen(launcher(cmd), **kwargs))
    proc.args, proc.own_session = cmd, bool(kwargs.get("start_new_session"))
    with _lock:
        _children.difference_update([p for p in _children if p.returncode is not None])
        _children.add(proc)
    return proc


def run(cmd, *, timeout: float | None = None, capture_output: bool = False, input=None, **kwargs):
    """``subprocess.run`` over ``popen`` (no ``check``): on a timeout or an interrupt the child's whole
    process group is killed before the error goes on (it runs in a session of its own)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:  # a timeout, Ctrl-C
            kill_group(proc)
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL):
    """``sig`` to ``proc``'s process group if it leads one of its own, else to ``proc``; gone is fine."""
    try:
        if getattr(proc, "own_session", False) and hasattr(os, "killpg"):
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path, lines: int = 15) -> str:
    """The last ``lines`` lines of a child's log file, for an error message; '' where it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(collections.deque(f, maxlen=lines))
    except OSError:
        return ""


def stop_children(timeout: float = STOP_TIMEOUT_S):
    """SIGTERM to every child ``popen`` started that still runs, then SIGKILL to the process groups of those
    still there after ``timeout`` (and to what is left of the others' groups: a ``vllm serve``'s engine core)."""
    with _lock:
        live = [p for p in _children if p.poll() is None]
    for p in live:
        try:
            p.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if p.poll() is None or getattr(p, "own_session", False):
            kill_group(p)
        try:
            p.wait(1.0)
        except subprocess.TimeoutExpired:
            pass


atexit.register(stop_children)


def _launch(argv: list[str]) -> int:
    """The launcher: ``PARENT_PID -- CMD...``. Sets the death signal and becomes ``CMD``; without ``prctl``,
    runs ``CMD`` as its child and stops its process group when the parent goes."""
    parent, cmd = int(argv[0]), argv[2:]
    if _death_signal(signal.SIGTERM):
        if os.getppid() != parent:  # the parent went before the signal was set
            return 0
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            print(f"cannot run {cmd[0]}: {exc}", file=sys.stderr)
            return 127
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _: child.send_signal(s))
    while child.poll() is None:
        if os.getppid() != parent:
            child.terminate()
            try:
                child.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():  # our own group: the command's children
                os.killpg(os.getpid(), signal.SIGKILL)  # (and us)
            break
        try:
            child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            pass
    return child.wait()


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
