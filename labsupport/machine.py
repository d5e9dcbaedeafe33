"""The machine a measurement ran on: recorded with every saved run (``machine``), named in captions (``describe_machine``).

Runs on these shared cloud VMs are compared only by ratios within one run; across runs a reader needs to know
which machine each was, and "AMD EPYC" alone does not say: two VMs reporting it ran at very different speeds. The CPU
family and the vector units tell them apart, so they are recorded beside the core count and the versions.
Both the benchmarks (which record it) and the plots (which caption a saved run with it) read this module.
"""
from __future__ import annotations

import datetime
import os
import platform

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # the vector units that tell two "AMD EPYC"s apart


def _cpuinfo(key: str) -> str | None:
    if not os.path.exists("/proc/cpuinfo"):
        return None
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith(key)), None)


def machine() -> dict:
    """This machine now: the time, the CPU (model, family, vector units, cores), torch's threads and the versions."""
    cpu = _cpuinfo("model name") or platform.processor()
    flags = set((_cpuinfo("flags") or "").split())
    import torch
    import transformers
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu,
            "cpu_family": _cpuinfo("cpu family"), "isa": [f for f in ISA_FLAGS if f in flags],
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def describe_machine(m: dict) -> str:
    """One line for a caption: ``AMD EPYC (family 25, AVX2, 2 cores)``; older records lack family and ISA."""
    isa = m.get("isa")
    vectors = None if isa is None else ("AVX-512" if "avx512f" in isa else "AVX2" if "avx2" in isa else "no AVX2")
    details = [f"family {m['cpu_family']}" if m.get("cpu_family") else None, vectors,
               f"{m['cores']} cores" if m.get("cores") else None]
    return f"{m.get('cpu', 'an unnamed CPU')} ({', '.join(d for d in details if d)})"
