"""vLLM's Python, started once and kept for a chapter: offline greedy runs and ``vllm bench serve`` in it.

Every ``vllm`` command and every script that imports vLLM spends much of its start-up on imports (torch,
transformers, vLLM) before its first request, and chapter 08 asks vLLM's venv for three small jobs:
section 1's offline ``LLM``, section 3's two ``vllm bench serve`` runs and section 6's check of a recipe
against ``vllm serve``'s parser. ``VllmSession`` starts
``bench/offline/vllm_session.py`` in ``.venv-vllm`` once; each job is one JSON line to it and one back.
``vllm bench serve`` runs there as the ``vllm`` command's own ``main()`` with the same arguments: vLLM's
parser, vLLM's code, only the import is shared. Start it early (``start()`` returns at once) and its
import overlaps other work, e.g. servers starting::

    session = VllmSession().start()
    greedy = offline.greedy_tokens(folder, prompts, 24, session=session)
    rows = bench.measure(servers, load, folder, tok, session=session)
    session.stop()

The process ends with its parent however that ends (``labsupport.procs``); an interrupted or timed-out
job stops it, and the next job starts a fresh one, so a cell re-run never reads a stale answer.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .. import procs
from ..bench.offline.vllm_runner import cpu_env, default_python
from ..servers import vllm_status

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "offline" / "vllm_session.py"


class VllmSession:
    """One long-lived Python of vLLM's venv. ``log_path``: where vLLM's own output goes."""

    def __init__(self, python: str | os.PathLike | None = None):
        self.python = Path(python) if python else default_python()
        self.proc: subprocess.Popen | None = None
        self.ready_info: dict | None = None
        self.log_path = os.path.join(tempfile.gettempdir(), f"labsupport-vllm-session-{os.getpid()}.log")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def environment(self) -> dict:
        """``offline.greedy_tokens``' settings (OpenMP on every core, none reserved, vLLM's CPU platform,
        its engine in this one process) and a client's (nothing online); the script runs a ``vllm`` command
        on one thread, as ``servers.client_env`` gives ``vllm bench serve``."""
        env = cpu_env()
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        return env

    def start(self) -> "VllmSession":
        """Start the process and return at once: its import goes on while the caller does other work."""
        if self.alive:
            return self
        usable, why = vllm_status()
        if not usable:
            raise RuntimeError(why)
        with open(self.log_path, "a") as log:
            self.proc = procs.popen([str(self.python), str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=self.environment(), cwd=tempfile.gettempdir(),
                                    start_new_session=True, text=True, bufsize=1)
        self.ready_info = None
        return self

    def ready(self, timeout_s: float = 300.0) -> dict:
        """Wait until vLLM is imported; its version and how long the import took."""
        self.start()
        if self.ready_info is None:
            self.ready_info = self._answer(timeout_s, "the import")
        return self.ready_info

    def ask(self, request: dict, timeout_s: float = 600.0) -> dict:
        """One job: the answer's dict (``ok``, ``seconds``, and the job's fields); RuntimeError if it failed."""
        self.ready()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout_s, next(iter(request)))
        if not answer.get("ok"):
            raise RuntimeError(f"{answer.get('error', 'failed')} (log: {self.log_path}):\n{self.log_tail()}")
        return answer

    def _answer(self, timeout_s: float, what: str) -> dict:
        """The next line the process writes, within ``timeout_s``; on a timeout, an interrupt or its death the
        process is stopped (a late answer must not be read as the next job's)."""
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                if not sel.select(timeout_s):
                    raise TimeoutError(f"vLLM's session gave no answer to {what} within {timeout_s:.0f} s "
                                       f"(log: {self.log_path})")
            line = self.proc.stdout.readline()
            if not line:  # its stdout closed: it has exited, or is exiting
                try:
                    code = self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    code = "still running, stdout closed"
                raise RuntimeError(f"vLLM's session exited ({code}) during {what} "
                                   f"(log: {self.log_path}):\n{self.log_tail()}")
            return json.loads(line)
        except BaseException:
            self.stop()
            raise

    def vllm(self, args: list[str], timeout_s: float = 600.0) -> dict:
        """``vllm ARGS...`` in the session (``["bench", "serve", ...]``)."""
        return self.ask({"vllm": [str(a) for a in args]}, timeout_s)

    def greedy(self, spec: dict, timeout_s: float = 600.0) -> dict:
        """vLLM's offline ``LLM``, greedy, on ``spec`` (``offline.greedy_tokens`` builds it)."""
        return self.ask({"greedy": spec}, timeout_s)

    def parse_serve(self, lines: list[str], timeout_s: float = 120.0) -> list[dict]:
        """What ``vllm serve``'s own parser makes of each command line (``disagg.check_recipe``)."""
        return self.ask({"parse_serve": list(lines)}, timeout_s)["parsed"]

    def log_tail(self, lines: int = 15) -> str:
        return procs.log_tail(self.log_path, lines)

    def stop(self, timeout: float = 10.0):
        """Close its stdin (it exits), then SIGTERM and SIGKILL to its group if it lingers; safe twice."""
        if self.proc is None:
            return
        proc, self.proc, self.ready_info = self.proc, None, None
        deadline = time.time() + timeout
        for step in (lambda: proc.stdin.close(), lambda: procs.kill_group(proc, signal.SIGTERM), lambda: procs.kill_group(proc)):
            try:
                step()
                proc.wait(max(0.1, (deadline - time.time()) / 2))
                break
            except (subprocess.TimeoutExpired, OSError, ValueError):
                continue
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except (OSError, ValueError):
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
