"""Workers as real OS processes: start, wait until healthy, kill, restart. Chapter 07 and its tests use it.

A PD deployment is several servers, each with its own engine and KV pool, so each is its own
process here too (``python -m labsupport serve --role prefill|decode``), never threads of the
notebook's kernel: a killed worker must really be gone, and its cores must really be its own.

On a 2-core machine ``cpus`` pins each worker to one core (``--cpu-affinity``; torch then uses
one thread), so prefill and decode cannot slow each other down by sharing cores, only by what
they share on purpose: the KV transfer. A colocated server for comparison gets both cores.

Every process is started by ``procs.popen``: it ends when the notebook's kernel does, restarted, killed
or exited (a worker left behind holds its port and about a gigabyte).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from .. import procs
from ..serve.background import free_port  # a port no bind to port 0 can take meanwhile


class Worker:
    """One ``python -m labsupport serve`` process. ``role``: "prefill", "decode", "both" or None (colocated).

    ``args``: more ``serve`` flags (``["--max-num-batched-tokens", "2048"]``, ``["--enable-chunked-prefill"]``)."""

    def __init__(self, role: str | None = None, cpus: str | None = None, port: int | None = None,
                 model: str | None = None, args: list[str] | tuple = (), name: str | None = None):
        self.role, self.cpus, self.model, self.args = role, cpus, model, list(args)
        self.port = port or free_port()
        self.name = name or f"{role or 'colocated'}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(tempfile.gettempdir(), f"labsupport-worker-{self.port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "labsupport", "serve", "--port", str(self.port), "--log-level", "warning",
               *self.args]
        if self.model:
            cmd += ["--model", self.model]
        if self.role:
            cmd += ["--role", self.role]
        if self.cpus:
            cmd += ["--cpu-affinity", self.cpus]
        return cmd

    def start(self, wait: bool = True, timeout: float = 180.0) -> "Worker":
        if self.alive:
            return self
        with open(self.log_path, "w") as log:
            self.proc = procs.popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                    start_new_session=True)
        if wait:
            self.wait_healthy(timeout)
        return self

    def environment(self) -> dict:
        """The process's environment: ours, with torch's threads matching the pinned cores."""
        env = dict(os.environ)
        if self.cpus:
            env["OMP_NUM_THREADS"] = str(len(_cpu_list(self.cpus)))
        return env

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 180.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.alive:
                raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"worker {self.name} was not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return procs.log_tail(self.log_path, lines)

    def kill(self):
        """SIGKILL: the crash a router must survive (no goodbye, sockets reset)."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0):
        """SIGTERM: a clean stop (requests in flight get an error, the process exits 0)."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, wait: bool = True) -> "Worker":
        self.kill()
        return self.start(wait)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _cpu_list(spec: str) -> set[int]:
    cpus = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus |= set(range(int(lo), int(hi or lo) + 1))
    return cpus


def start_all(workers: list[Worker], timeout: float = 180.0, wait: bool = True) -> list[Worker]:
    """Start every worker at once (their model loads overlap), then wait for each; stop all if one fails.
    A worker already running is not started again, so ``start_all(ws, wait=False)`` early and ``start_all(ws)``
    where they are needed lets their start-ups overlap other work in between."""
    try:
        for w in workers:
            w.start(wait=False)
        for w in workers if wait else ():
            w.wait_healthy(timeout)
    except BaseException:
        stop_all(workers)
        raise
    return workers


def stop_all(workers: list[Worker], timeout: float = 15.0):
    """SIGTERM to every worker at once, then wait for each (stopping them one by one costs their shutdowns
    summed); one still running after ``timeout`` is killed."""
    for w in workers:
        if w.alive:
            try:
                w.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + timeout
    for w in workers:
        if w.proc is None:
            continue
        try:
            w.proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            w.kill()


class Router(Worker):
    """``python -m labsupport router`` as its own process: PD mode (``prefill``/``decode`` workers) or
    instance mode (``instances`` with a ``policy``)."""

    def __init__(self, prefill=(), decode=(), instances=(), policy: str | None = None, port: int | None = None,
                 args: list[str] | tuple = ()):
        super().__init__(None, None, port, None, args, name=None)
        self.prefill, self.decode, self.instances, self.policy = list(prefill), list(decode), list(instances), policy
        self.name = f"router:{self.port}"

    def command(self) -> list[str]:
        def urls(ws):
            return ",".join(w.url if isinstance(w, Worker) else str(w) for w in ws)
        cmd = [sys.executable, "-m", "labsupport", "router", "--port", str(self.port), *self.args]
        if self.prefill:
            cmd += ["--prefill", urls(self.prefill), "--decode", urls(self.decode)]
        if self.instances:
            cmd += ["--instances", urls(self.instances)]
        if self.policy:
            cmd += ["--policy", self.policy]
        return cmd
