"""The vLLM project's production router (``vllm-router``, Rust) in front of our workers, as a process.

Chapter 07's router is the lesson; this is what an attendee who outgrows one machine runs instead.
It speaks vLLM's worker contract (``/health``, ``/v1/*``, ``kv_transfer_params``, KV-cache events), and
our workers speak it too, so it drives them unchanged:

* colocated: ``ProductionRouter(workers=[a, b], policy="round_robin")`` (or ``power_of_two``,
  ``cache_aware``, ``kv_aware`` with ``kv_events={url: endpoint}``: see ``serve/kv_events.py``);
* PD: ``ProductionRouter(prefill=[p], decode=[d])``: ``--vllm-pd-disaggregation``, the router sends the
  prompt to the prefill worker with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``,
  then the request to the decode worker with the parameters prefill returned.

It is installed beside the other outside clients (``make clients``: ``.venv-clients``); ``router_binary()``
finds it there or on PATH. Like our workers, it runs in its own session and is killed with the
notebook's kernel (``procs.popen``); its Prometheus port is a free one, so two routers can run at once.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx

from .cluster import Worker, free_port

HOW_TO_INSTALL = "vllm-router is not installed: run `make clients` (it installs vllm-router==0.1.17 into .venv-clients)"


def router_binary() -> Path | None:
    """``vllm-router`` from ``.venv-clients`` (``make clients``), else from PATH; None when neither has it."""
    local = Path(__file__).resolve().parents[2] / ".venv-clients" / "bin" / "vllm-router"
    if local.exists():
        return local
    found = shutil.which("vllm-router")
    return Path(found) if found else None


def _url(worker) -> str:
    return worker.url if isinstance(worker, Worker) else str(worker).rstrip("/")


class ProductionRouter(Worker):
    """``vllm-router`` as a process: ``start()`` waits until it answers ``/health``; ``stop()``/``kill()`` as a worker.

    ``workers``: colocated workers (``--worker-urls``) under ``policy``; or ``prefill`` + ``decode`` for PD mode.
    ``kv_events``: ``{worker or url: "tcp://127.0.0.1:PORT"}``, the event endpoint of each worker, for
    ``policy="kv_aware"``, and ``kv_replay`` their replay endpoints; ``block_size`` must be the workers'
    ``--block-size``, ``model`` their model folder (the router tokenizes prompts with its tokenizer).
    ``args``: more flags (``["--health-check-interval-secs", "1"]``)."""

    def __init__(self, workers=(), prefill=(), decode=(), policy: str = "round_robin", port: int | None = None,
                 kv_events: dict | None = None, kv_replay: dict | None = None, block_size: int = 16,
                 model: str | None = None, args: list[str] | tuple = ()):
        super().__init__(None, None, port, None, args)
        self.workers, self.prefill, self.decode = list(workers), list(prefill), list(decode)
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD mode needs both prefill and decode workers")
        if self.workers and self.prefill:
            raise ValueError("give colocated workers or prefill + decode workers, not both")
        if not (self.workers or self.prefill):
            raise ValueError("no workers to route to")
        if kv_events and policy != "kv_aware":
            raise ValueError(f"kv_events feed policy 'kv_aware', not {policy!r}")
        if kv_events and not model:
            raise ValueError("kv_aware needs the workers' model (its folder): the router tokenizes prompts with it")
        self.policy, self.kv_events, self.block_size, self.model = policy, dict(kv_events or {}), block_size, model
        self.kv_replay = dict(kv_replay or {})
        self.prometheus_port = free_port()  # the default, 29000, would collide between two routers
        self.name = f"vllm-router:{self.port}"

    def command(self) -> list[str]:
        binary = router_binary()
        if binary is None:
            raise FileNotFoundError(HOW_TO_INSTALL)
        cmd = [str(binary), "--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
               "--log-level", "warning"]
        if self.prefill:
            cmd += ["--vllm-pd-disaggregation"]
            for w in self.prefill:
                cmd += ["--prefill", _url(w)]
            for w in self.decode:
                cmd += ["--decode", _url(w)]
        else:
            cmd += ["--worker-urls", *(_url(w) for w in self.workers)]
        for worker, endpoint in self.kv_events.items():
            cmd += ["--kv-event-source", f"{_url(worker)}={endpoint}"]
        for worker, endpoint in self.kv_replay.items():
            cmd += ["--kv-event-replay-source", f"{_url(worker)}={endpoint}"]
        if self.kv_events:
            cmd += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", str(self.model)]
        return [*cmd, *self.args]

    def environment(self) -> dict:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # its launcher is the clients venv's Python, not ours
        return env

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        """Its Prometheus text (requests per worker, retries, circuit breakers)."""
        return httpx.get(f"http://127.0.0.1:{self.prometheus_port}/metrics", timeout=5).text
