"""The simulated clock against a real run: the same workload through the real engine on this machine and
through the simulated one with a ``cpu`` profile fitted on this machine.

``error`` is relative, (predicted - measured) / measured, for the median TTFT, TPOT and end-to-end latency and
the output throughput; ``measured`` is the mean of ``repeats`` real runs. The workloads are not the
calibration's (``calibrate.py`` times prefills, decode batches and chunks in isolation; these mix them under
arrivals).

Which profile: a shared 2-core machine changes speed from hour to hour (``benchmarks/README.md``: the
simulated clock), and a profile fitted at another hour predicts that hour's machine.
So by default the validation fits its own profile **around** the real runs: the calibration once before them
and once after, both sets of steps in one fit. What is left is the model's own error (five counts cannot see
everything a step does) and the runs' noise, which ``aa_error`` measures: each later real run against the
first, printed beside the simulation's error to be read against it. The cached profile's error is reported
too (``error_cached``) where one exists: what a user who simulates without recalibrating gets.
"""
from __future__ import annotations

import math

from ..bench.offline.workload import poisson_workload
from ..bench.summary import summarize

ERROR_KEYS = {"ttft_p50": "p50_ttft_ms", "tpot_p50": "p50_tpot_ms", "latency_p50": "p50_latency_ms",
              "output_throughput": "output_throughput"}
COMPARED = (*ERROR_KEYS.values(), "engine_steps", "duration_s", "num_preemptions")


def default_workloads(tokenizer) -> dict:
    """Two workloads (each run for real twice, so kept small): Poisson arrivals of prompts and answers of many
    lengths, and a batch arriving at once."""
    return {"poisson-mixed": poisson_workload(tokenizer, 40, rate=1.0, input_lens=range(32, 257, 16),
                                              output_lens=range(8, 65, 8), seed=3),
            "batch-at-once": poisson_workload(tokenizer, 16, input_lens=range(64, 193, 16),
                                              output_lens=range(16, 49, 8), seed=4)}


def relative_errors(measured: dict, predicted: dict) -> dict:
    return {name: (predicted[key] - measured[key]) / measured[key] if measured[key] else math.nan
            for name, key in ERROR_KEYS.items()}


def measure_once(llm, workload, clock: str = "wall") -> dict:
    """The workload for real (``run_workload`` on ``llm``), its prefix cache emptied first as the simulated
    engine's starts: the compared figures."""
    from ..bench.offline.driver import run_workload
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine holds requests: a validation run needs it idle")
    before = llm.engine.num_steps
    preempted = llm.engine.scheduler.num_preemptions
    outputs, duration = run_workload(llm, workload, use_tqdm=False, clock=clock)
    measured = {k: v for k, v in summarize(outputs, duration).items() if k in COMPARED}
    measured["engine_steps"] = llm.engine.num_steps - before
    measured["num_preemptions"] = llm.engine.scheduler.num_preemptions - preempted
    return measured


def mean_of(runs: list[dict]) -> dict:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def compare(runs: list[dict], workload, profile: dict, clock: str = "wall", **engine_options) -> dict:
    """The real runs of one workload against its simulation on ``profile``: ``measured`` (their mean),
    ``predicted``, ``error``; with two runs or more, ``aa_error``: each later run against the first, the band
    the machine's own noise gives."""
    from .simulate import simulate
    predicted = {k: v for k, v in simulate(workload, profile, clock=clock, **engine_options).items()
                 if k in COMPARED}
    measured = mean_of(runs)
    out = {"requests": len(workload), "runs": runs, "measured": measured, "predicted": predicted,
           "error": relative_errors(measured, predicted)}
    if len(runs) > 1:
        out["aa_error"] = {name: max(abs(e) for e in errors) for name, errors in
                           zip(ERROR_KEYS, zip(*[relative_errors(runs[0], r).values() for r in runs[1:]]))}
    return out


def validate(workloads: dict | None = None, llm=None, profile: dict | None = None, repeats: int = 2,
             clock: str = "wall", quick: bool = False, **engine_options) -> dict:
    """Every workload (default: ``default_workloads``) run ``repeats`` times for real, then simulated.

    ``profile``: None fits the ``cpu`` profile around the real runs (calibration before and after, see the
    module's doc) and also reports the cached one's error; a dict: that profile only. ``llm``: a CPU float32
    ``LLM`` built with ``engine_options`` (made if None). ``clock``: how the workloads' arrival times read.
    ``quick``: the short calibration (tests)."""
    from ..bench.offline.workload import warmup_prompts
    from ..engine.request import SamplingParams
    from .calibrate import cached_cpu_profile, calibration_runs, profile_from_records
    if llm is None:
        from ..llm import LLM
        llm = LLM(device="cpu", dtype="float32", **engine_options)
    workloads = workloads or default_workloads(llm.tokenizer)
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts(llm.tokenizer)],
                 SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # first steps are slower
    fitted_here = profile is None
    records = calibration_runs(llm, quick) if fitted_here else []
    runs = {name: [measure_once(llm, workload, clock) for _ in range(repeats)] for name, workload in workloads.items()}
    cached = None
    if fitted_here:
        records += calibration_runs(llm, quick, seed=12)
        profile = profile_from_records(llm, records, "cpu")
        profile["fitted_around_runs"] = True
        cached = cached_cpu_profile()
    results = {}
    for name, workload in workloads.items():
        results[name] = compare(runs[name], workload, profile, clock, **engine_options)
        if cached is not None:
            results[name]["error_cached"] = compare(runs[name], workload, cached, clock, **engine_options)["error"]
    out = {"profile": profile["name"], "profile_date": profile["date"], "profile_fit": profile["fit"],
           "fitted_around_runs": fitted_here, "repeats": repeats, "workloads": results}
    if cached is not None:
        out["cached_profile_date"] = cached["date"]
    return out


def format_validation(v: dict) -> str:
    how = "fitted around these runs" if v.get("fitted_around_runs") else f"fitted {v['profile_date']}"
    lines = [f"simulated (profile {v['profile']}, {how}; median step error {v['profile_fit']['median_abs_rel_error']:.1%}"
             f" over {v['profile_fit']['n_steps']} calibration steps) against {v.get('repeats', 1)} real run(s) "
             f"on this machine (measured: their mean)"]
    cached = "cached_profile_date" in v
    lines.append(f"{'workload':16s}{'metric':20s}{'measured':>12s}{'predicted':>12s}{'error':>9s}{'real A/A':>10s}"
                 + (f"{'cached ' + v['cached_profile_date']:>20s}" if cached else ""))
    for name, r in v["workloads"].items():
        for label, key in ERROR_KEYS.items():
            aa = f"{r['aa_error'][label]:10.1%}" if "aa_error" in r else f"{'':10s}"
            old = f"{r['error_cached'][label]:+20.1%}" if "error_cached" in r else ""
            lines.append(f"{name:16s}{label:20s}{r['measured'][key]:12.1f}{r['predicted'][key]:12.1f}"
                         f"{r['error'][label]:+9.1%}{aa}{old}")
        lines.append(f"{name:16s}{'engine steps':20s}{r['measured']['engine_steps']:12.1f}"
                     f"{r['predicted']['engine_steps']:12d}")
        lines.append(f"{name:16s}{'requests':20s}{r['requests']:12d}")
    return "\n".join(lines)
