"""Drive the engine with a workload in real time: requests join when their arrival time comes.

The driver is the "clients": it adds each request to the engine at its arrival time and steps
the engine whenever there is work, sleeping only when the engine is idle until the next
arrival. Queueing, TTFT and TPOT therefore include waiting for the engine, as users see them.
``on_step`` receives the engine after every step (the timeline widget listens there, reading
``engine.last_step``).

``clock="steps"`` reads each arrival time as a step number instead of seconds: the request
joins just before that step. Runs are then identical on any machine, which is what a story
told step by step (chapter 04's users a to e) needs; latencies are still measured in seconds.
"""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from ...engine.request import SamplingParams
from .workload import BenchRequest


def run_workload(llm, workload: list[BenchRequest], on_step=None, use_tqdm: bool = True, clock: str = "wall"):
    """Return ``(outputs in workload order, wall seconds)``."""
    if clock not in ("wall", "steps"):
        raise ValueError(f"clock must be 'wall' or 'steps', got {clock!r}")
    engine = llm.engine
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    requests = [None] * len(workload)
    bar = tqdm(total=len(workload), desc="Benchmark", unit="req", disable=not use_tqdm)
    start, steps = time.perf_counter(), 0
    while pending or engine.has_unfinished_requests():
        now = steps if clock == "steps" else time.perf_counter() - start
        while pending and workload[pending[0]].arrival_time <= now:
            i = pending.pop(0)
            spec = workload[i]
            requests[i] = engine.add_request(spec.prompt_token_ids,
                                             SamplingParams(max_tokens=spec.max_tokens, temperature=0,
                                                            ignore_eos=True), request_id=spec.request_id)
            if clock == "wall":
                requests[i].metrics.arrival_time = start + spec.arrival_time  # when the user sent it
        if engine.has_unfinished_requests():
            bar.update(sum(r.is_finished for r in engine.step()))
            steps += 1
            if on_step is not None:
                on_step(engine)
        elif pending and clock == "steps":
            steps += 1  # an idle step: nothing to run until the next arrival
        elif pending:
            time.sleep(max(0.0, workload[pending[0]].arrival_time - (time.perf_counter() - start)))
    bar.close()
    return [engine.output(r) for r in requests], time.perf_counter() - start
