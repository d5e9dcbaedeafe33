"""Chapter 05's online and offline work on one engine: walk-ins, and paperwork that fills the gaps.

A serving fleet sized for its daytime peak idles much of the time, and offline work (summarizing
a day's documents, scoring a dataset, generating training data) could use those idle slots. Mixed
naively, the two hurt each other: with first come, first served, an interactive request arriving
behind a queue of batch jobs waits for all of them to be admitted. vLLM's answer is
``--scheduling-policy priority``: each request carries a ``priority`` (smaller first), the waiting
queue is ordered by it, and when memory runs out the least urgent running request is preempted.
Offline jobs go in with a larger value and take whatever the interactive ones leave.

The experiment (``online_offline``) runs one workload three times on one offline ``LLMEngine``:
the interactive requests alone, then mixed with a batch of longer offline jobs under first come,
first served, then mixed under ``"priority"`` with interactive 0 and batch 1. Interactive requests
arrive at steps drawn from a seeded Poisson process, so every run sees the same arrivals.

Arrivals and the TTFT the assertions use are counted in engine *steps*, not seconds: which request
runs in which step depends only on token counts (``ignore_eos``, fixed ``max_tokens``), so the
step counts are the same on any machine and a test of them cannot flake. The seconds are measured
too, and printed beside them: they are what a user feels, and they vary from run to run.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..bench.summary import percentile
from ..engine.request import SamplingParams


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int  # added to the engine just before this step runs
    interactive: bool  # a walk-in (priority 0), or paperwork (priority 1 under the priority policy)


def mixed_jobs(num_interactive: int = 8, interactive_prompt: int = 24, interactive_tokens: int = 8,
               mean_gap_steps: float = 6.0, first_arrival: int = 4, num_batch: int = 16, batch_prompt: int = 64,
               batch_tokens: tuple[int, int] = (8, 24), seed: int = 0, token_range: tuple[int, int] = (200, 20000)
               ) -> list[Job]:
    """The batch jobs, all queued at step 0 (each with its own output length in ``batch_tokens``, so slots free
    one by one), and the interactive requests arriving from ``first_arrival`` with exponential gaps of mean
    ``mean_gap_steps`` (a Poisson process on the step clock). Prompts are random token ids: no two share a
    prefix, so the prefix cache cannot blur the comparison."""
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(*token_range) for _ in range(n)]

    jobs = [Job(f"batch-{i}", prompt(batch_prompt), rng.randint(*batch_tokens), 0, False) for i in range(num_batch)]
    step = float(first_arrival)
    for i in range(num_interactive):
        jobs.append(Job(f"chat-{i}", prompt(interactive_prompt), interactive_tokens, round(step), True))
        step += rng.expovariate(1 / mean_gap_steps)
    return jobs


def run_jobs(engine, jobs: list[Job], policy: str, **options) -> dict:
    """Run ``jobs`` to completion on ``engine`` with ``scheduling_policy=policy`` (and ``options``, restored
    afterwards). Under ``"priority"`` interactive jobs get priority 0 and batch jobs 1; under any other policy
    all get 0 (the engine refuses any other value there). Returns the interactive requests' TTFT in steps
    (from the step before which a request arrived to the step that gave its first token, both counted) and
    in ms, and for the batch its output tokens, the step its last job finished and the seconds until then."""
    pending = sorted(jobs, key=lambda j: j.arrival_step)
    requests, first_step, last_step, step = {}, {}, {}, 0
    start = time.perf_counter()
    with engine.options(scheduling_policy=policy, **options):
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].arrival_step <= step:
                job = pending.pop(0)
                priority = 1 if policy == "priority" and not job.interactive else 0
                params = SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True)
                requests[job.request_id] = engine.add_request(job.prompt_token_ids, params, job.request_id,
                                                              priority=priority)
            if engine.has_unfinished_requests():
                for req in engine.step():
                    first_step.setdefault(req.request_id, step)
                    last_step[req.request_id] = step
            step += 1  # with nothing to run until the next arrival, an idle step: the clock goes on
    chats = [j for j in jobs if j.interactive]
    batch = [requests[j.request_id] for j in jobs if not j.interactive]
    return {
        "policy": policy,
        "ttft_steps": [first_step[j.request_id] - j.arrival_step + 1 for j in chats],
        "ttft_ms": [1000 * requests[j.request_id].metrics.ttft for j in chats],
        "batch_tokens": sum(len(r.output_token_ids) for r in batch),
        "batch_last_step": max((last_step[r.request_id] + 1 for r in batch), default=None),
        "batch_s": max((r.metrics.finished_time - start for r in batch), default=None),
        "steps": step,
        "tokens": {rid: list(r.output_token_ids) for rid, r in requests.items()},
    }


def online_offline(engine, jobs: list[Job], **options) -> dict[str, dict]:
    """The three runs: the interactive requests alone, mixed first come first served, mixed with priorities."""
    chats = [j for j in jobs if j.interactive]
    return {"interactive alone": run_jobs(engine, chats, "continuous", **options),
            "mixed, first come first served": run_jobs(engine, jobs, "continuous", **options),
            "mixed, priority (interactive 0, batch 1)": run_jobs(engine, jobs, "priority", **options)}


def report(results: dict[str, dict]) -> str:
    """One line per run: interactive TTFT P50/P90 in steps and ms, the batch's throughput."""
    lines = []
    for name, r in results.items():
        steps, ms = r["ttft_steps"], r["ttft_ms"]
        line = (f"{name:42s} interactive TTFT P50 {percentile(steps, 50):5.1f} steps ({percentile(ms, 50):6.0f} ms), "
                f"P90 {percentile(steps, 90):5.1f} steps ({percentile(ms, 90):6.0f} ms)")
        if r["batch_tokens"]:
            line += (f" | batch: {r['batch_tokens']} tokens by step {r['batch_last_step']}, "
                     f"{r['batch_tokens'] / r['batch_s']:5.1f} tokens/s")
        lines.append(line)
    return "\n".join(lines)
