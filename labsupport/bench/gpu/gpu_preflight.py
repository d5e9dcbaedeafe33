"""``make gpu-preflight``: the first thing to run on a GPU machine, in one command and at most 6 minutes.

A GPU is lent to this project now and then for about 15 minutes, so the first run on a new card must tell the
most for the least: no bundle (the image's own python3 with CUDA torch, triton and transformers), random weights
(no checkpoint, no network), and every part guarded, so that a part that fails or runs out of time is recorded
and the others still run. In order of what they are worth:

1. ``versions``: the machine (GPU name, memory, driver, CPU cores) and the packages (torch, CUDA, triton,
   transformers, numpy, Python).
2. ``profile``: the step-cost profile of the simulated clock for the default model's shape and Llama-3.1-8B's,
   bf16 (``gpu_profile.py``), each also written as ``<device>-<model>.json``, ready for
   ``labsupport/data/sim_profiles/``.
3. ``probes``: what the chapters assert, measured at GPU scale (``gpu_probes.py``).
4. ``gpu_check``: every part of ``make gpu-check`` (``gpu_check.parts``), as long as time is left.

Everything goes under ``--out DIR``: ``preflight.json`` (rewritten after every part, so a stopped command still
returns what ran), ``preflight.log`` (this run's output) and the profiles. A global ``--deadline`` (seconds from
the start) bounds the whole run: a part gets at most its own budget and never more than what is left, enforced
by an alarm that interrupts it between two Python lines; a part not started by then is recorded as skipped.
``--device cpu --quick`` runs every part on tiny float32 shapes (``make gpu-preflight-rehearsal``, in
``make test``), so a typo costs a CPU minute, not the GPU's. It imports only what the GPU image has
(``labsupport/data/gpu_image_packages.txt``): the JSON lists the distributions it imported, and the test checks
them against that list.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

DEADLINE_S = 330  # of the 6 minutes: Python's start, imports and the last JSON write take the rest
QUICK_DEADLINE_S = 480  # room for a loaded 2-core CI machine (the rehearsal's time: docs/gpu.md)
BUDGETS_S = {  # each part's own limit on a GPU (the deadline may cut it shorter); --quick: QUICK_BUDGET_S each
    "versions": 20, "profile smollm2-135m": 45, "profile llama-3.1-8b": 70, "capture_beside_copy": 25,
    "raised_max_num_seqs": 25, "recompute_and_cache": 60, "chunked_prefill": 30, "engines_fit": 30,
    "gpu_check parity": 25, "gpu_check kernel": 20, "gpu_check compute_less": 60, "gpu_check chunked_prefill": 60,
    "gpu_check decode": 40, "gpu_check w1": 60,
}
QUICK_BUDGET_S = 120
MIN_START_S = 5  # a part with less than this left is not started
QUICK_SHAPES = {"quick-smollm2-135m": "smollm2-135m", "quick-llama-3.1-8b": "llama-3.1-8b"}


class PartTimeout(Exception):
    """Raised inside a part by the alarm when its time is up."""


class Tee:
    """Everything printed goes to the terminal and to the log file."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.stream.write(text)
        self.log.write(text)
        self.log.flush()
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()


class Preflight:
    def __init__(self, out: Path, device, quick: bool, deadline_s: float):
        self.out, self.device, self.quick = out, device, quick
        self.started = time.perf_counter()
        self.stop_at = self.started + deadline_s
        self.report = {"quick": quick, "device": str(device), "deadline_s": deadline_s, "parts": {},
                       "versions": {}, "profile": {}, "probes": {}, "gpu_check": {}}

    def left(self) -> float:
        return self.stop_at - time.perf_counter()

    def run(self, section: str, key: str, name: str, fn, *args):
        """Run ``fn(*args)`` as part ``name``; its result (or why it has none) goes to ``report[section][key]``."""
        budget = min(QUICK_BUDGET_S if self.quick else BUDGETS_S[name], self.left())
        status = {"budget_s": round(budget, 1)}
        if budget < MIN_START_S:
            result = {"skipped": f"not started: {self.left():.0f} s left of the deadline"}
        else:
            print(f"== {name} (at most {budget:.0f} s)", flush=True)
            started = time.perf_counter()
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, budget)
            try:
                result = fn(*args)
            except PartTimeout:
                result = {"error": f"stopped after its {budget:.0f} s"}
            except Exception as exc:  # recorded, and the next part runs
                traceback.print_exc()
                result = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            status["seconds"] = round(time.perf_counter() - started, 2)
            _release(self.device)
        status["status"] = "skipped" if "skipped" in result else "error" if "error" in result else "ok"
        if isinstance(result, dict):
            result.setdefault("seconds", status.get("seconds", 0.0))
        self.report[section][key] = result
        self.report["parts"][name] = status
        print(f"   {name}: {status['status']}" + (f" ({result.get('error') or result.get('skipped')})"
                                                   if status["status"] != "ok" else f" in {status['seconds']} s"))
        self.save()

    def save(self):
        self.report["seconds"] = round(time.perf_counter() - self.started, 2)
        self.report["ok"] = all(p["status"] == "ok" for p in self.report["parts"].values())
        (self.out / "preflight.json").write_text(json.dumps(self.report, indent=2, default=str) + "\n")


def _on_alarm(signum, frame):
    raise PartTimeout()


def _release(device):
    import gc
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ 1. versions

def versions(device) -> dict:
    import importlib.metadata as md
    import torch

    out = {"python": platform.python_version(), "platform": platform.platform(), "cpu_cores": os.cpu_count(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    for name in ("triton", "transformers", "numpy", "safetensors", "tokenizers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out |= {"gpu_name": props.name, "gpu_memory_bytes": props.total_memory,
                "gpu_capability": f"{props.major}.{props.minor}", "gpu_multiprocessors": props.multi_processor_count}
        try:
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=15)
            out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
            out["driver"] = out["nvidia_smi"].split(",")[-1].strip() if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return out


def device_slug(report_versions: dict, device) -> str:
    """``h100``, ``h200``, ... from the GPU's name (``cpu`` without one): the profiles' name prefix."""
    if device.type != "cuda":
        return "cpu-rehearsal"
    name = report_versions.get("gpu_name", "gpu").lower()
    found = re.search(r"\b([a-z]+\d+[a-z]*)\b", name.replace("nvidia", ""))
    return found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def imported_modules() -> dict[str, list[str]]:
    """Top-level modules that this project's loaded modules import (read from their source) and that this run did
    import, outside the standard library, each with the distributions that provide it here: what the GPU image
    must have (``tests/test_gpu_preflight.py`` checks them against its list). What those packages import in turn
    is their own version's business: the image's versions differ from this venv's."""
    import ast
    import importlib.metadata as md
    owners, names = md.packages_distributions(), set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] != "labsupport" or not path or not path.endswith(".py"):
            continue
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        except (OSError, SyntaxError):  # a file changed or gone since it was imported: its import is in sys.modules
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {m: sorted(owners.get(m, [])) for m in sorted(names)
            if m in sys.modules and m not in sys.stdlib_module_names and m != "labsupport"}


# ------------------------------------------------------------------ 2. the profile

def profile_part(pre: Preflight, spec: str, shape: str, dtype, slug: str):
    from .gpu_profile import fit_profile, measure_model

    def part():
        stop_at = time.perf_counter() + 0.8 * min(QUICK_BUDGET_S if pre.quick else BUDGETS_S[f"profile {shape}"],
                                                  pre.left())  # the rest: the overhead run and the fit
        measured = measure_model(spec, pre.device, dtype, pre.quick, stop_at)
        machine = {k: pre.report["versions"].get(k) for k in ("gpu_name", "gpu_memory_bytes", "driver", "torch",
                                                               "cuda", "triton", "cpu_cores")}
        machine["quick"] = pre.quick
        name = f"{slug}-{shape}"
        profile = fit_profile(name, measured, machine, str(dtype).removeprefix("torch."),
                              pre.report["versions"].get("gpu_name") or platform.machine())
        try:
            from ...sim.profiles import save_profile
            save_profile(profile, pre.out / f"{name}.json")
        except ImportError:  # the simulated clock is older than this file: write the same JSON by hand
            (pre.out / f"{name}.json").write_text(json.dumps(profile, indent=2) + "\n")
        return {"profile": profile, "records": measured["records"], "file": f"{name}.json"}

    pre.run("profile", shape, f"profile {shape}", part)


# ------------------------------------------------------------------ main

def register_quick_shapes():
    """The quick run's models: the real shapes' heads (so the kernels see the course's head shapes), everything
    else shrunk to what a CPU runs in milliseconds; registered as ``random:quick-...``."""
    from ...models.loader import RANDOM_MODELS
    for quick, real in QUICK_SHAPES.items():
        RANDOM_MODELS[quick] = dataclasses.replace(RANDOM_MODELS[real], num_layers=2, hidden_size=128,
                                                   intermediate_size=256, vocab_size=1024)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport.bench.gpu.gpu_preflight",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for preflight.json, preflight.log and the profiles")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --quick: the rehearsal)")
    p.add_argument("--quick", action="store_true", help="tiny float32 shapes: a rehearsal of the script")
    p.add_argument("--deadline", type=float, default=None,
                   help=f"seconds for the whole run (default {DEADLINE_S}; --quick {QUICK_DEADLINE_S})")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "preflight.log", "w", encoding="utf-8")
    sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: the kernel runs on numpy
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here: run it on the GPU machine, or rehearse with --device cpu --quick")
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pre = Preflight(out, device, args.quick, args.deadline or (QUICK_DEADLINE_S if args.quick else DEADLINE_S))
    print(f"gpu-preflight on {device} into {out} ({datetime.datetime.now().isoformat(timespec='seconds')})")
    pre.run("versions", "machine", "versions", lambda: versions(device))
    pre.report["versions"] = pre.report["versions"].pop("machine")
    slug = device_slug(pre.report["versions"], device)
    if args.quick:
        register_quick_shapes()
    for shape in QUICK_SHAPES.values():
        spec = f"random:quick-{shape}" if args.quick else f"random:{shape}"
        profile_part(pre, spec, shape, dtype, slug)
    from .gpu_probes import PROBES
    for name, probe in PROBES:
        pre.run("probes", name, name, probe, device, dtype, args.quick)
    from . import gpu_check
    from .gpu_decode import copy_bandwidth
    copy_bw = copy_bandwidth(device, (64 << 20) if args.quick else (1 << 30))
    pre.report["gpu_check"]["copy_gb_s"] = copy_bw / 1e9
    order = ("parity", "kernel", "compute_less", "chunked_prefill", "decode", "w1")  # the never-run parts early
    listed = {name: (fn, fn_args) for name, fn, fn_args in gpu_check.parts(device, args.quick, dtype, copy_bw)}
    for name in order:
        fn, fn_args = listed[name]
        pre.run("gpu_check", name, f"gpu_check {name}", fn, *fn_args)
    pre.report["versions"]["imported_modules"] = imported_modules()
    pre.save()
    print(f"== done in {pre.report['seconds']:.0f} s: " + ", ".join(f"{k} {v['status']}"
                                                                    for k, v in pre.report["parts"].items()))
    return 0 if pre.report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
