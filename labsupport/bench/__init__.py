"""Benchmarks with the numbers a serving engineer reads: workloads, a driver, and metrics.

    from labsupport.bench import poisson_workload, run_workload, summarize
    results = run_workload(llm, poisson_workload(tokenizer, num_requests=32, rate=4.0))
    print(summarize(results))

``python -m labsupport bench --help`` runs the same from the command line, at any size.
"""
from .offline.driver import run_workload
from .summary import summarize
from .offline.workload import BenchRequest, long_prompt_workload, poisson_workload

__all__ = ["BenchRequest", "long_prompt_workload", "poisson_workload", "run_workload", "summarize"]
