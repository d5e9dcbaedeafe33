"""The real engine on a simulated clock: build it from a profile, drive it with a workload, summarize the run.

What is modelled: everything the engine decides. The real ``Scheduler`` (its policy, chunked prefill,
preemption by recompute, priorities), ``KVCacheManager`` (blocks, prefix cache, CPU-tier bookkeeping) and
lifecycle run unchanged, as do any pieces an attendee plugs in (``engine.plugged``). What is not: the model's
numerics (``SimRunner`` returns filler tokens, EOS only as a seeded draw); a step's duration is a linear
model of five counts (``cost_model.py``), so whatever it cannot see (CPU contention, a cold cache, kernel
choice by shape, prefill overlapping decode) is not there; the scheduler's own time is folded into the
``step`` coefficient; no weights are loaded and no KV tensors allocated, so an 8B model on an 80 GB GPU
simulates on a laptop. Arrival, token and finish times are virtual seconds: the same inputs give the same
numbers, on any machine.
"""
from __future__ import annotations

import dataclasses
import math

from ..bench.offline.workload import BenchRequest
from ..bench.summary import summarize
from ..engine.config import EngineConfig
from ..engine.engine import LLMEngine
from ..engine.kv_cache_manager import KVCacheManager
from ..engine.request import SamplingParams
from .profiles import block_bytes, cost_model, load_profile, model_config
from .virtual_runner import SimRunner, VirtualClock, bookkeeping_cpu_tier


def simulated_engine(profile, stop_probability: float = 0.0, seed: int = 0, clock: VirtualClock | None = None,
                     connector=None, **engine_options) -> LLMEngine:
    """An ``LLMEngine`` of the real scheduler, KV manager and lifecycle around a ``SimRunner`` on a virtual clock
    (``engine.clock``; ``clock``: one made by the caller), for the model shape and KV budget of ``profile`` (a
    name, file or dict). Engine options are ``EngineConfig``'s; ``num_blocks`` wins over the profile's
    ``kv_cache_bytes``. ``connector``: a KV connector for prefill/decode disaggregation (``kv_link.SimConnector``)."""
    profile = load_profile(profile)
    cfg = model_config(profile)
    config = EngineConfig(device="cpu", **engine_options)
    if config.kv_cache != "paged":
        raise ValueError("the simulated engine models the paged KV cache only (kv_cache='paged')")
    limit = cfg.max_position_embeddings
    from ..engine import build
    config = dataclasses.replace(config, max_model_len=min(config.max_model_len or min(limit, 8192), limit),
                                 chunk_cost_context=build.chunk_cost_context(config, cfg))
    num_blocks = config.num_blocks or profile["kv_cache_bytes"] // block_bytes(profile, config.block_size)
    if num_blocks < 1:
        raise ValueError(f"profile {profile['name']!r}: its KV budget holds no block of {config.block_size} tokens")
    tier = bookkeeping_cpu_tier(num_blocks, config.cpu_offload_blocks, config.block_size) \
        if config.cpu_offload_blocks else None
    kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                        cpu_tier=tier)
    kv.copy_block = lambda src, dst: None  # copy-on-write moves no bytes here
    clock = clock or VirtualClock()
    eos = profile.get("eos_token_ids", [cfg.vocab_size - 1])
    runner = SimRunner(cost_model(profile), clock, eos, stop_probability, seed)
    engine = LLMEngine.from_parts(config, kv, runner, cfg.vocab_size, eos, clock, connector)
    engine.profile = profile
    return engine


@dataclasses.dataclass
class StepLog:
    """What every simulated step did: counts to check invariants against and report beside the times."""

    tokens: list[int] = dataclasses.field(default_factory=list)  # tokens fed
    seqs: list[int] = dataclasses.field(default_factory=list)  # sequences in the step
    blocks_used: list[int] = dataclasses.field(default_factory=list)  # pool blocks held after it
    schedules: list[dict] = dataclasses.field(default_factory=list)  # {request id: tokens fed}, if kept

    def record(self, engine: LLMEngine, keep_schedule: bool):
        out = engine.last_step
        if out is None or out.index != len(self.tokens):
            return  # an empty step (nothing schedulable) is no step in the engine's record
        self.tokens.append(out.total_tokens)
        self.seqs.append(len(out.requests))
        self.blocks_used.append(engine.kv.num_blocks - engine.kv.allocator.num_free)
        if keep_schedule:
            self.schedules.append({r.request_id: n for r, n in zip(out.requests, out.num_new_tokens)})


def run_simulated(engine: LLMEngine, workload: list[BenchRequest], keep_schedule: bool = False, clock: str = "wall",
                  ignore_eos: bool = True):
    """``run_workload`` on virtual time: each request joins when the clock reaches its arrival; when the engine is
    idle the clock jumps to the next arrival. ``clock="steps"`` reads arrivals as step numbers, as the real driver
    does. Returns ``(outputs in workload order, simulated seconds, StepLog)``."""
    if clock not in ("wall", "steps"):
        raise ValueError(f"clock must be 'wall' or 'steps', got {clock!r}")
    vclock, log = engine.clock, StepLog()
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    requests, at, steps = [None] * len(workload), 0, 0
    while at < len(pending) or engine.has_unfinished_requests():
        now = steps if clock == "steps" else vclock()
        while at < len(pending) and workload[pending[at]].arrival_time <= now:
            spec = workload[pending[at]]
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=ignore_eos)
            sent = spec.arrival_time if clock == "wall" else None  # when the user sent it, not when the loop saw it
            requests[pending[at]] = engine.add_request(spec.prompt_token_ids, params, request_id=spec.request_id,
                                                       arrival_time=sent)
            at += 1
        if engine.has_unfinished_requests():
            before = engine.num_steps
            engine.step()
            steps += 1
            log.record(engine, keep_schedule)
            if engine.num_steps == before:  # nothing could be scheduled: only a later arrival can change that
                if at == len(pending) or clock == "steps":
                    raise RuntimeError("the simulated engine cannot schedule its waiting requests")
                vclock.jump_to(workload[pending[at]].arrival_time)
        elif clock == "steps":
            steps += 1  # an idle step: nothing to run until the next arrival
        else:
            vclock.jump_to(workload[pending[at]].arrival_time)
    return [engine.output(r) for r in requests], vclock(), log


def with_gamma_arrivals(workload: list[BenchRequest], rate: float, burstiness: float, seed: int = 0):
    """The same requests arriving with gamma gaps (shape ``burstiness``, mean ``1/rate``): ``bench serve``'s
    arrival process (``serve_datasets.arrival_times``); burstiness 1 is Poisson, below 1 burstier."""
    from ..bench.serving.serve_datasets import arrival_times
    times = arrival_times(len(workload), rate, burstiness, seed) if math.isfinite(rate) else [0.0] * len(workload)
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(workload, times)]


def slo_figures(outputs, slo: dict[str, float], duration_s: float) -> dict:
    """Goodput (``bench serve``'s definition: requests a second meeting every SLO) and SLO attainment."""
    from ..bench.serving.serve_bench import RequestResult, goodput
    results = [RequestResult(len(o.prompt_token_ids), len(o.token_ids), success=True,
                             start_time=o.metrics.arrival_time, ttft=o.metrics.ttft, latency=o.metrics.latency,
                             itl=o.metrics.itl, output_tokens=len(o.token_ids)) for o in outputs]
    met = goodput(results, slo, 1.0)  # over one second: the count of requests that met every SLO
    return {"slo": dict(slo), "request_goodput": goodput(results, slo, duration_s),
            "slo_attainment": met / len(results) if results else math.nan}


def simulate_run(workload: list[BenchRequest], profile="cpu", slo: dict | None = None,
                 usd_per_hour: float | None = None, keep_schedule: bool = False, stop_probability: float = 0.0,
                 seed: int = 0, clock: str = "wall", **engine_options):
    """``simulate``'s run, with what a check reads afterwards: ``(summary, engine, outputs, StepLog)``."""
    engine = simulated_engine(profile, stop_probability, seed, **engine_options)
    outputs, duration, log = run_simulated(engine, workload, keep_schedule, clock, ignore_eos=stop_probability == 0)
    s = summarize(outputs, duration)
    kv, counters = engine.kv, engine.scheduler.lifecycle.counters
    peak = max(log.blocks_used, default=0)
    s.update({"simulated": True, "profile": engine.profile["name"], "profile_source": engine.profile["source"],
              "engine_steps": engine.num_steps, "tokens_computed": sum(log.tokens),
              "prompt_tokens_computed": counters["prompt_tokens_computed"],
              "generation_tokens": counters["generation_tokens"], "num_preemptions": engine.scheduler.num_preemptions,
              "kv_blocks_total": kv.num_blocks, "kv_peak_blocks": peak, "kv_peak_fraction": peak / kv.num_blocks,
              "prefix_cache_hits": kv.counters["prefix_cache_hits"], "cpu_tier_hits": kv.counters["cpu_tier_hits"],
              "busy_fraction": engine.runner.busy_s / duration if duration > 0 else math.nan,
              "max_step_tokens": max(log.tokens, default=0), "max_step_seqs": max(log.seqs, default=0),
              "config": {k: v for k, v in dataclasses.asdict(engine.config).items() if k in REPORTED_OPTIONS}})
    if slo:
        s.update(slo_figures(outputs, slo, duration))
    if usd_per_hour is not None:
        s["usd_per_hour"] = usd_per_hour
        s["usd_per_million_output_tokens"] = (usd_per_hour / 3600 / s["output_throughput"] * 1e6
                                              if s["total_output_tokens"] else math.nan)
    if keep_schedule:
        s["schedule"] = log.schedules
    return s, engine, outputs, log


REPORTED_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                    "block_size", "num_blocks", "scheduling_policy", "cpu_offload_blocks",
                    "long_prefill_token_threshold", "max_model_len")


def simulate(workload: list[BenchRequest], profile="cpu", **options) -> dict:
    """Run ``workload`` on a simulated engine (``simulated_engine``) and return ``bench``'s summary keys
    (``summarize``) plus: goodput and SLO attainment (``slo={"ttft": ms, "tpot": ms, "e2el": ms}``), cost per
    million output tokens (``usd_per_hour``), KV use (peak blocks, preemptions, prefix hits), engine steps and
    tokens computed, ``"simulated": True`` and the profile's name. No wall time is in it: the same inputs give
    the same dict. ``options``: ``simulate_run``'s and ``EngineConfig``'s."""
    return simulate_run(workload, profile, **options)[0]
