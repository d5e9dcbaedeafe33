"""The simulated clock against a real run: the same workload through the real engine on this machine and
through the simulated one with this machine's fitted ``cpu`` profile.

``error`` is relative, (predicted - measured) / measured, for the median TTFT, TPOT and end-to-end latency and
the output throughput. The two default workloads are not the calibration's (``calibrate.py`` times prefills,
decode batches and chunks in isolation; these mix them under arrivals). A real run on a shared machine varies
from run to run, often by more than the model's error: each workload runs for real ``repeats`` times, and the
spread of the real runs (``aa_error``) is printed beside the simulation's error, to be read against it.
"""
from __future__ import annotations

import math

from ..bench.offline.workload import poisson_workload
from ..bench.summary import summarize

ERROR_KEYS = {"ttft_p50": "p50_ttft_ms", "tpot_p50": "p50_tpot_ms", "latency_p50": "p50_latency_ms",
              "output_throughput": "output_throughput"}
COMPARED = (*ERROR_KEYS.values(), "engine_steps", "duration_s", "num_preemptions")


def default_workloads(tokenizer) -> dict:
    """Two small workloads (about half a minute each for real here): Poisson arrivals of mixed lengths, and a
    batch arriving at once."""
    return {"poisson-mixed": poisson_workload(tokenizer, 12, rate=0.8, input_lens=(48, 160), output_lens=(12, 40),
                                              seed=3),
            "batch-at-once": poisson_workload(tokenizer, 8, input_lens=(96,), output_lens=(24,), seed=4)}


def relative_errors(measured: dict, predicted: dict) -> dict:
    return {name: (predicted[key] - measured[key]) / measured[key] if measured[key] else math.nan
            for name, key in ERROR_KEYS.items()}


def measure_once(llm, workload) -> dict:
    """The workload for real (``run_workload`` on ``llm``): the compared figures."""
    from ..bench.offline.driver import run_workload
    before = llm.engine.num_steps
    outputs, duration = run_workload(llm, workload, use_tqdm=False)
    measured = {k: v for k, v in summarize(outputs, duration).items() if k in COMPARED}
    measured["engine_steps"] = llm.engine.num_steps - before
    measured["num_preemptions"] = sum(o.metrics.num_preemptions for o in outputs)
    return measured


def validate_one(llm, workload, profile: dict, repeats: int = 2, **engine_options) -> dict:
    """One workload real and simulated: ``measured`` (the first real run), ``predicted``, ``error``; with
    ``repeats`` >= 2, ``aa_error``: the later real runs against the first, the band the machine's own noise
    gives, which the simulation's error is read against."""
    from .simulate import simulate
    runs = [measure_once(llm, workload) for _ in range(repeats)]
    predicted = {k: v for k, v in simulate(workload, profile, **engine_options).items() if k in COMPARED}
    out = {"requests": len(workload), "measured": runs[0], "predicted": predicted,
           "error": relative_errors(runs[0], predicted)}
    if repeats > 1:
        out["aa_error"] = {name: max(abs(e) for e in errors) for name, errors in
                           zip(ERROR_KEYS, zip(*[relative_errors(runs[0], r).values() for r in runs[1:]]))}
    return out


def validate(workloads: dict | None = None, llm=None, recalibrate: bool = False, profile: dict | None = None,
             repeats: int = 2, **engine_options) -> dict:
    """Every workload (default: ``default_workloads``) real and simulated on the ``cpu`` profile (or ``profile``,
    one fitted on this machine). ``llm``: a CPU float32 ``LLM`` built with ``engine_options`` (made if None)."""
    from ..bench.offline.workload import warmup_prompts
    from ..engine.request import SamplingParams
    from .calibrate import cpu_profile
    if llm is None:
        from ..llm import LLM
        llm = LLM(device="cpu", dtype="float32", **engine_options)
    profile = profile or cpu_profile(recalibrate=recalibrate, llm=llm)
    workloads = workloads or default_workloads(llm.tokenizer)
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts(llm.tokenizer)],
                 SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # first steps are slower
    results = {name: validate_one(llm, workload, profile, repeats, **engine_options)
               for name, workload in workloads.items()}
    return {"profile": profile["name"], "profile_date": profile["date"], "profile_fit": profile["fit"],
            "workloads": results}


def format_validation(v: dict) -> str:
    lines = [f"simulated (profile {v['profile']}, fitted {v['profile_date']}) against a real run on this machine",
             f"{'workload':16s}{'metric':20s}{'measured':>12s}{'predicted':>12s}{'error':>9s}{'real A/A':>10s}"]
    for name, r in v["workloads"].items():
        for label, key in ERROR_KEYS.items():
            aa = f"{r['aa_error'][label]:10.1%}" if "aa_error" in r else ""
            lines.append(f"{name:16s}{label:20s}{r['measured'][key]:12.1f}{r['predicted'][key]:12.1f}"
                         f"{r['error'][label]:+9.1%}{aa}")
        lines.append(f"{name:16s}{'engine steps':20s}{r['measured']['engine_steps']:12d}"
                     f"{r['predicted']['engine_steps']:12d}")
    return "\n".join(lines)
