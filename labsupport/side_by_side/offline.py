"""vLLM's offline ``LLM`` on the same token ids as our engine: do both pick the same greedy tokens?

vLLM lives in ``.venv-vllm`` with its own torch, so it runs as a subprocess of that venv's Python:
``bench/offline/vllm_worker.py`` in its greedy mode, a real script file (vLLM spawns its engine core,
which re-imports the main module: a script piped on stdin fails). Token ids go in and come out as
JSON, so no tokenizer stands between the two engines. Settings as for the chapter's servers:
fp32 (bf16 gave garbage for this model on CPU), eager, block size 32, the CPU environment of
``bench compare`` (``vllm_runner.cpu_env``). By default vLLM runs its engine core and its model
worker as two more processes, each importing torch and vLLM again; for a handful of prompts the
engine runs in the script's own process instead (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which
saves those two imports (much of the start-up: ``benchmarks/README.md``) and gives the same tokens.
Pass every prompt in one call all the same.

Greedy decoding is deterministic in each engine, but two engines add the same numbers in different
orders: where the best two logits are nearly tied, one rounding can flip the choice, and from there
on the continuations differ. ``compare_tokens`` says where that happens, if anywhere.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from .. import procs
from ..bench.offline.vllm_runner import WORKER, cpu_env, default_python
from ..pd.cluster import _cpu_list
from ..servers import vllm_status


def greedy_tokens(folder, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True, cpus: str | None = None,
                  timeout_s: float = 600.0, session=None) -> dict:
    """vLLM's greedy continuation of each prompt: ``{"tokens": [[id, ...], ...], "startup_s", "generate_s",
    "vllm_version", "torch_version"}``, or ``{"skipped": why}`` when vLLM is absent or fails (the
    notebook prints why and goes on). ``folder``: the safetensors + tokenizer folder
    (``models.loader.prepare_default_model()``); ``cpus``: bind vLLM's threads to these cores
    ("1"), e.g. to match a server pinned there; default all. ``session``: a running
    ``session.VllmSession`` to do it in (vLLM already imported there; ``cpus`` does not apply)."""
    usable, why = vllm_status()
    if not usable:
        return {"skipped": why}
    longest = max(len(p) for p in prompts) + max_tokens
    spec = {"mode": "greedy", "model": str(folder), "prompts": [[int(t) for t in p] for p in prompts],
            "max_tokens": int(max_tokens), "ignore_eos": bool(ignore_eos), "max_model_len": max(256, longest + 16)}
    if session is not None:
        try:
            answer = session.greedy(spec, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            return {"skipped": f"vLLM failed: {exc}"}
        return {k: answer[k] for k in ("tokens", "startup_s", "generate_s", "vllm_version", "torch_version")}
    work = Path(tempfile.mkdtemp(prefix="labsupport-vllm-greedy-"))
    (work / "spec.json").write_text(json.dumps(spec))
    log_path = work / "vllm.log"
    env = cpu_env()
    if cpus:
        env.update({"VLLM_CPU_OMP_THREADS_BIND": cpus, "OMP_NUM_THREADS": str(len(_cpu_list(cpus)))})
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process, not three: two fewer imports of torch and vLLM
    try:
        with open(log_path, "w") as out:
            done = procs.run([str(default_python()), str(WORKER), str(work / "spec.json"),
                                   str(work / "result.json")], stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout_s, cwd=work)
    except subprocess.TimeoutExpired:
        return {"skipped": f"vLLM did not finish within {timeout_s:.0f} s (log: {log_path})"}
    if done.returncode != 0 or not (work / "result.json").exists():
        return {"skipped": f"vLLM failed with exit code {done.returncode} (log: {log_path}):\n{procs.log_tail(log_path)}"}
    return json.loads((work / "result.json").read_text())


def compare_tokens(ours: list[list[int]], theirs: list[list[int]] | dict) -> list[dict]:
    """Per prompt: ``equal``, ``first_diff`` (the first position where the two differ, None if equal; a
    shorter list differs where it ends), the two lengths, and the two tokens at ``first_diff``.
    ``theirs`` may be ``greedy_tokens``' whole answer."""
    if isinstance(theirs, dict):
        if "skipped" in theirs:
            raise RuntimeError(theirs["skipped"])
        theirs = theirs["tokens"]
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} prompts against {len(theirs)}")
    rows = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a, b = [int(t) for t in a], [int(t) for t in b]
        diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        rows.append({"prompt": i, "equal": diff is None, "first_diff": diff, "ours_len": len(a), "theirs_len": len(b),
                     "ours_token": a[diff] if diff is not None and diff < len(a) else None,
                     "theirs_token": b[diff] if diff is not None and diff < len(b) else None})
    return rows
