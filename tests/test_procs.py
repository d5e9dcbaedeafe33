"""``labsupport.procs``: children end with their parent, however it ends (issue 41, defect 8).

Each test runs a real parent process (a Python script) that starts real children the way the
chapters do, kills or ends that parent, and looks for the children by pid.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from labsupport import procs
from waiting import wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` seconds (empty: all gone)."""
    try:
        wait_until(lambda: all(gone(p) for p in pids), timeout)
    except AssertionError:
        pass  # the caller names the survivors
    return [p for p in pids if not gone(p)]


def start_parent(body: str, env=None) -> tuple[subprocess.Popen, dict]:
    """A parent script that starts children and prints ``{name: pid}`` as one JSON line, then sleeps."""
    code = textwrap.dedent(body) + "\nimport json, sys, time\nprint(json.dumps(pids), flush=True)\ntime.sleep(300)\n"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})})
    line = parent.stdout.readline()
    assert line, "the parent script failed"
    return parent, json.loads(line)


PARENT = f"""
import subprocess, sys, threading
from labsupport import procs
from labsupport.pd.cluster import Router
SLEEPER = {SLEEPER!r}
pids = {{}}
pids["session"] = procs.popen(SLEEPER, start_new_session=True).pid      # as chapter 07's workers
pids["plain"] = procs.popen(SLEEPER).pid
def from_a_thread():                                                   # a thread that ends at once
    pids["thread"] = procs.popen(SLEEPER, start_new_session=True).pid
t = threading.Thread(target=from_a_thread); t.start(); t.join()
pids["router"] = Router(instances=["http://127.0.0.1:9"]).start(wait=False).proc.pid   # a real router process
"""


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["prctl", "watcher"])
def test_children_end_within_seconds_when_their_parent_is_killed(pdeathsig):
    parent, pids = start_parent(PARENT, env={} if pdeathsig else {"LABSUPPORT_NO_PDEATHSIG": "1"})
    try:
        # the thread that started one of them has ended: it must still run. A bounded look at something that
        # must not happen (a child dying with its thread), so a fixed wait is the test itself
        time.sleep(1.0)
        assert not [name for name, pid in pids.items() if gone(pid)], pids
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_gone(pids.values(), timeout=5 if pdeathsig else 15) == []
    finally:
        for pid in pids.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_that_calls_die_with_parent_ends_with_it():
    """The engine-core case: a child started with plain ``subprocess`` calls ``die_with_parent()`` itself."""
    child = ("from labsupport import procs; import time; procs.die_with_parent(); "
             "print('ready', flush=True); time.sleep(300)")
    body = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
pids = {{"child": child.pid}}
"""
    for env in ({}, {"LABSUPPORT_NO_PDEATHSIG": "1"}):
        parent, pids = start_parent(body, env)
        try:
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            assert wait_gone(pids.values(), timeout=5) == [], env
        finally:
            for pid in pids.values():
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)


def test_children_are_stopped_at_a_normal_exit_too():
    """atexit: the script ends, its children go with it (SIGTERM first: they may clean up)."""
    code = f"""
import sys
from labsupport import procs
print(procs.popen({SLEEPER!r}, start_new_session=True).pid, flush=True)
sys.exit(0)
"""
    env = {**os.environ, "LABSUPPORT_NO_PDEATHSIG": "1"}  # the exit alone, not the kernel's death signal
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    pid = int(done.stdout.split()[0])
    assert wait_gone([pid], timeout=2) == []


def test_stop_children_and_run():
    kids = [procs.popen(SLEEPER, start_new_session=True) for _ in range(2)]
    procs.stop_children(timeout=5)
    assert [k.poll() for k in kids] == [-signal.SIGTERM] * 2
    done = procs.run([sys.executable, "-c", "print('hi')"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "hi\n" and done.args[0] == sys.executable
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run(SLEEPER, timeout=1)
    with pytest.raises(FileNotFoundError):
        procs.popen(["no-such-command-here"])


def test_log_tail_gives_the_last_lines_and_never_raises(tmp_path):
    log = tmp_path / "worker.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(40)) + b"bad \xff byte\n")
    assert procs.log_tail(log, 3) == "line 38\nline 39\nbad \ufffd byte\n"  # undecodable bytes replaced, not raised
    assert procs.log_tail(log).count("\n") == 15
    assert procs.log_tail(tmp_path / "missing.log") == ""  # a child that never wrote its log: no error on the error path
