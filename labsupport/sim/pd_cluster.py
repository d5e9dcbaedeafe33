"""Several simulated engines on one virtual clock: colocated replicas behind a router policy, and prefill/decode
disaggregation (1P1D, xPyD) with the prompt's KV crossing a timed link.

    from labsupport.sim.pd_cluster import simulate_pd, max_goodput_rate
    s = simulate_pd(workload, "h100-llama-3.1-8b", layout="1P1D", link={"bandwidth_gbps": 25, "latency_ms": 0.05},
                    slo={"ttft": 500, "tpot": 50})        # bench's keys, per-engine KV and steps, transfer bytes

**The loop.** Each engine (``simulated_engine``: its own scheduler, KV pool, step-cost model and clock) is busy
until its clock; the shared virtual time moves to whichever comes first: an event (a request reaching the router,
a prefill's answer reaching it, a request ending) or the engine whose next step starts earliest (ties: events
first, then engines in order). A step runs at once but what it finishes is an event at the step's end, so the
router never sees an answer before the client could. An engine that cannot schedule anything waits for a request
or for its connector's next landing or release (``SimConnector.next_event_time``).

**The router.** ``pd/routing.py``'s policies, unchanged (``RoundRobin``, ``LeastLoaded``, ``PrefixAware``, an
``SLOAware`` object): each decision is ``choose(engine names, {"prompt": token ids})``, and ``done(name)`` when the
request ends there, as ``pd/router.py`` does over HTTP. What is adapted: the candidates are engine names
(``replica-0``, ``prefill-0``, ``decode-1``) instead of URLs, all always healthy; the body is the token ids a
completions request would carry (``PrefixAware`` hashes them written out, as the real router does for token ids).

**PD** (as ``pd/router.py`` and vLLM's proxy): a prefill engine (round robin) gets the request capped at one token
with ``do_remote_decode``; when it ends, its answer's ``kv_transfer_params`` go with the original request to a
decode engine (least loaded), whose real scheduler takes the prompt's KV through ``SimConnector`` (``kv_link.py``)
and recomputes only the last prompt token. The client's first token is the decode engine's: TTFT is prefill wait
and compute, the hand-off, the pull and that first decode step. Every engine gets the profile's KV budget (one GPU
each): compare layouts of the same number of engines (``replicas=2`` against 1P1D) or per engine.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import re

from ..bench.offline.workload import BenchRequest
from ..bench.summary import summarize
from ..engine.config import EngineConfig
from ..engine.request import SamplingParams
from ..pd.routing import Shed, make_policy
from ..measure import AGAIN
from ..percentiles import percentile
from .kv_link import KVLink, SimConnector
from .profiles import block_bytes, load_profile
from .simulate import REPORTED_OPTIONS, simulated_engine, slo_figures, with_gamma_arrivals
from .virtual_runner import VirtualClock

PREFILL_PARAMS = {"do_remote_decode": True}  # what the router asks a prefill engine for (router.PREFILL_KV_PARAMS)


@dataclasses.dataclass
class Node:
    """One simulated engine of the cluster: its name (the router's candidate), role and what it did."""

    name: str
    role: str  # "instance", "prefill" or "decode"
    engine: object
    blocked: bool = False  # tried and could schedule nothing: waits for a request, a landing or a release
    peak_blocks: int = 0
    steps_tokens: list[int] = dataclasses.field(default_factory=list)
    steps_seqs: list[int] = dataclasses.field(default_factory=list)

    def ready_time(self) -> float:
        e = self.engine
        if not (e.has_unfinished_requests() or e.has_pending_transfers()):
            return math.inf
        if not self.blocked:
            return e.clock()
        due = e.connector.next_event_time() if e.connector is not None else math.inf
        return max(due, e.clock())

    def wake(self, t: float):
        self.engine.clock.jump_to(t)  # never backwards: a busy engine sees it at its next step
        self.blocked = False

    def step(self, t: float) -> list:
        e = self.engine
        e.clock.jump_to(t)
        before = e.num_steps
        got = e.step()
        self.blocked = e.num_steps == before
        self.peak_blocks = max(self.peak_blocks, e.kv.num_blocks - e.kv.allocator.num_free)
        if not self.blocked:
            self.steps_tokens.append(e.last_step.total_tokens)
            self.steps_seqs.append(len(e.last_step.requests))
        return [r for r in got if r.is_finished]


@dataclasses.dataclass
class Trace:
    """One request's way through the cluster, virtual seconds (PD fields None for a colocated one)."""

    request_id: str
    arrival: float
    engines: list[str] = dataclasses.field(default_factory=list)
    prefill_scheduled: float | None = None  # its prompt's first step on the prefill engine
    prefill_done: float | None = None  # the prefill answer reaches the router
    shed: bool = False


def parse_layout(layout: str, replicas: int = 1) -> tuple[int, int, int]:
    """``(instances, prefill, decode)`` engines for ``"colocated"`` (``replicas`` of them) or ``"xPyD"``."""
    if layout == "colocated":
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        return replicas, 0, 0
    m = re.fullmatch(r"(\d+)P(\d+)D", layout)
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ValueError(f"layout must be 'colocated' or 'xPyD' with x, y >= 1 (e.g. '1P1D', '2P1D'), got {layout!r}")
    return 0, int(m[1]), int(m[2])


class Cluster:
    """The engines, the router's policies, the link and the event loop (see the module's docstring)."""

    def __init__(self, profile, layout: str = "1P1D", replicas: int = 1, policy="round_robin",
                 prefill_policy="round_robin", decode_policy="least_loaded", link: dict | None = None,
                 stop_probability: float = 0.0, seed: int = 0, prefill_options: dict | None = None,
                 decode_options: dict | None = None, **engine_options):
        self.profile, self.layout = load_profile(profile), layout
        instances, prefill, decode = parse_layout(layout, replicas)
        self.link = KVLink(**(link or {}))
        self.stop_probability, self.nodes = stop_probability, []
        self.policies = {"instance": make_policy(policy), "prefill": make_policy(prefill_policy),
                         "decode": make_policy(decode_policy)}
        per_role = {"instance": {}, "prefill": prefill_options or {}, "decode": decode_options or {}}
        for role, count in (("instance", instances), ("prefill", prefill), ("decode", decode)):
            for k in range(count):
                name = f"{'replica' if role == 'instance' else role}-{k}"
                options = {**engine_options, **per_role[role]}
                clock, connector, size = VirtualClock(), None, options.get("block_size", EngineConfig.block_size)
                if role != "instance":
                    connector = SimConnector(name, size, block_bytes(self.profile, size), clock, self.link)
                engine = simulated_engine(self.profile, stop_probability, seed, clock=clock, connector=connector,
                                          **options)
                self.nodes.append(Node(name, role, engine))
        self.by_name = {n.name: n for n in self.nodes}
        self.events, self.order = [], itertools.count()  # (time, n, kind, payload): n keeps ties in posting order
        self.traces: dict[str, Trace] = {}
        self.specs: dict[str, BenchRequest] = {}  # request id -> what the client sent
        self.done: dict[str, object] = {}  # request id -> the client's Request (the last engine's)

    @property
    def pd(self) -> bool:
        return self.layout != "colocated"

    def post(self, t: float, kind: str, payload):
        heapq.heappush(self.events, (t, next(self.order), kind, payload))

    def route(self, role: str, prompt: list[int]) -> Node:
        names = [n.name for n in self.nodes if n.role == role]
        return self.by_name[self.policies[role].choose(names, {"prompt": prompt})]

    def run(self, workload: list[BenchRequest]):
        """Serve ``workload`` (arrivals in virtual seconds); returns ``(outputs in workload order, duration)``."""
        for i, spec in enumerate(workload):
            rid = spec.request_id or f"r{i}"
            if rid in self.traces:
                raise ValueError(f"request id {rid!r} appears twice in the workload")
            self.traces[rid] = Trace(rid, spec.arrival_time)
            self.post(spec.arrival_time, "arrive", (rid, spec))
        while True:
            t_event = self.events[0][0] if self.events else math.inf
            node, t_node = min(((n, n.ready_time()) for n in self.nodes), key=lambda x: x[1])
            if t_event == t_node == math.inf:
                break
            if t_event <= t_node:
                t, _, kind, payload = heapq.heappop(self.events)
                getattr(self, f"on_{kind}")(t, *payload)
            else:
                for req in node.step(t_node):
                    self.post(node.engine.clock(), "finish", (node, req))
        stuck = [n.name for n in self.nodes if n.engine.has_unfinished_requests()]
        if stuck:
            raise RuntimeError(f"engines {stuck} cannot schedule their waiting requests (a pool too small?)")
        outputs = []
        for rid, trace in self.traces.items():
            if not trace.shed:
                outputs.append(self.client_output(trace))
        return outputs, max(n.engine.clock() for n in self.nodes)

    def add(self, node: Node, t: float, rid: str, spec: BenchRequest, max_tokens: int, kv_params: dict | None):
        node.wake(t)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, kv_transfer_params=kv_params,
                                ignore_eos=self.stop_probability == 0 or node.role == "prefill")
        node.engine.add_request(spec.prompt_token_ids, params, request_id=rid, arrival_time=spec.arrival_time)
        self.traces[rid].engines.append(node.name)

    def on_arrive(self, t: float, rid: str, spec: BenchRequest):
        role = "prefill" if self.pd else "instance"
        try:
            node = self.route(role, spec.prompt_token_ids)
        except Shed:  # an SLO-aware policy refused it: the client got a 429 at once
            self.traces[rid].shed = True
            return
        self.specs[rid] = spec
        self.add(node, t, rid, spec, 1 if self.pd else spec.max_tokens, dict(PREFILL_PARAMS) if self.pd else None)

    def on_finish(self, t: float, node: Node, req):
        self.policies[node.role].done(node.name)
        trace = self.traces[req.request_id]
        if node.role != "prefill":
            self.done[req.request_id] = req
            return
        trace.prefill_scheduled, trace.prefill_done = req.metrics.first_scheduled_time, t
        spec = self.specs[req.request_id]
        decode = self.route("decode", spec.prompt_token_ids)
        self.add(decode, t, req.request_id, spec, spec.max_tokens, req.remote_kv.transfer_params)

    def client_output(self, trace: Trace):
        """What the client saw: the last engine's output; with PD, queued until the prefill engine took it up."""
        req = self.done[trace.request_id]
        out = self.by_name[trace.engines[-1]].engine.output(req)
        if trace.prefill_scheduled is not None:
            out.metrics = dataclasses.replace(out.metrics, first_scheduled_time=trace.prefill_scheduled)
        return out


def pd_figures(cluster: Cluster, outputs) -> dict:
    """Per engine and per role: steps, tokens, KV peak, busy share; with PD, the pulls (bytes, ms) and TTFT's parts."""
    engines = {}
    for n in cluster.nodes:
        e, counters = n.engine, n.engine.scheduler.lifecycle.counters
        engines[n.name] = {"role": n.role, "engine_steps": e.num_steps, "tokens_computed": sum(n.steps_tokens),
                           "prompt_tokens_computed": counters["prompt_tokens_computed"],
                           "generation_tokens": counters["generation_tokens"],
                           "num_preemptions": e.scheduler.num_preemptions, "kv_blocks_total": e.kv.num_blocks,
                           "kv_peak_blocks": n.peak_blocks, "kv_peak_fraction": n.peak_blocks / e.kv.num_blocks,
                           "prefix_cache_hits": e.kv.counters["prefix_cache_hits"], "busy_s": e.runner.busy_s,
                           "max_step_tokens": max(n.steps_tokens, default=0),
                           "max_step_seqs": max(n.steps_seqs, default=0)}
    roles = {}
    for role in ("instance", "prefill", "decode"):
        mine = [v for v in engines.values() if v["role"] == role]
        if mine:
            roles[role] = {"engines": len(mine), "kv_peak_blocks": max(v["kv_peak_blocks"] for v in mine),
                           "kv_peak_fraction": max(v["kv_peak_fraction"] for v in mine),
                           "tokens_computed": sum(v["tokens_computed"] for v in mine),
                           "prompt_tokens_computed": sum(v["prompt_tokens_computed"] for v in mine)}
    s = {"engines": engines, "roles": roles}
    if cluster.pd:
        ms = 1000.0
        pulls = list(cluster.link.transfers)
        traces, pull_of = [cluster.traces[o.request_id] for o in outputs], {p.request_id: p for p in pulls}
        parts = {"prefill_ttft": [(t.prefill_done - t.arrival) * ms for t in traces],
                 "handoff_wait": [(pull_of[t.request_id].start - t.prefill_done) * ms for t in traces],
                 "transfer": [(p.end - p.start) * ms for p in pulls],
                 "transfer_queue": [(p.begin - p.start) * ms for p in pulls]}
        bandwidth = cluster.link.bandwidth_gbps
        s.update({"link": {"bandwidth_gbps": bandwidth if math.isfinite(bandwidth) else None,  # None: free (JSON)
                           "latency_ms": cluster.link.latency_ms},
                  "kv_transfers": len(pulls), "kv_transfer_bytes": sum(p.num_bytes for p in pulls),
                  "kv_transfer_s": sum(p.end - p.start for p in pulls)})
        for name, values in parts.items():
            s[f"p50_{name}_ms"], s[f"p99_{name}_ms"] = percentile(values, 50), percentile(values, 99)
    return s


def simulate_pd_run(workload: list[BenchRequest], profile="cpu", layout: str = "1P1D", replicas: int = 1,
                    slo: dict | None = None, usd_per_hour: float | None = None, **options):
    """``simulate_pd``'s run with what a check reads afterwards: ``(summary, cluster, outputs)``."""
    cluster = Cluster(profile, layout, replicas, **options)
    outputs, duration = cluster.run(workload)
    s = summarize(outputs, duration)
    shed = sum(t.shed for t in cluster.traces.values())
    n_engines = len(cluster.nodes)
    s.update({"simulated": True, "profile": cluster.profile["name"], "profile_source": cluster.profile["source"],
              "layout": layout if layout != "colocated" else f"colocated x{replicas}", "num_engines": n_engines,
              "requests_shed": shed, **pd_figures(cluster, outputs),
              "config": {k: v for k, v in dataclasses.asdict(cluster.nodes[0].engine.config).items()
                         if k in REPORTED_OPTIONS}})
    for key in ("engine_steps", "tokens_computed", "prompt_tokens_computed", "num_preemptions", "prefix_cache_hits"):
        s[key] = sum(e[key] for e in s["engines"].values())
    s["busy_fraction"] = sum(e["busy_s"] for e in s["engines"].values()) / n_engines / duration if duration else 0.0
    if slo:
        s.update(slo_figures(outputs, slo, duration))
        if shed:  # a refused request met no SLO
            s["slo_attainment"] *= len(outputs) / (len(outputs) + shed)
        s["request_goodput_per_engine"] = s["request_goodput"] / n_engines
    if usd_per_hour is not None:  # the price of one engine's machine (one GPU), paid for every engine
        s["usd_per_hour"] = usd_per_hour * n_engines
        s["usd_per_million_output_tokens"] = (s["usd_per_hour"] / 3600 / s["output_throughput"] * 1e6
                                              if s["total_output_tokens"] else math.nan)
    return s, cluster, outputs


def simulate_pd(workload: list[BenchRequest], profile="cpu", layout: str = "1P1D", replicas: int = 1,
                policy="round_robin", link: dict | None = None, slo: dict | None = None, **options) -> dict:
    """Serve ``workload`` on simulated engines behind the router: ``layout`` ``"colocated"`` (``replicas`` engines,
    ``policy``: a ``routing.POLICIES`` name or a ``Policy``) or ``"xPyD"`` (``prefill_policy`` round robin and
    ``decode_policy`` least loaded, as ``pd/router.py``; ``link``: ``{"bandwidth_gbps": GB/s, "latency_ms": ms}``,
    default free). Returns ``simulate``'s summary keys (goodput and attainment with ``slo``) plus ``layout``,
    ``num_engines``, per-engine and per-role figures (``engines``, ``roles``: steps, tokens, KV peak), and with
    PD the pulls (``kv_transfer_bytes``, ``kv_transfer_s``, TTFT's parts at P50/P99). Deterministic. ``options``:
    ``stop_probability``, ``seed``, ``usd_per_hour`` (per engine), ``prefill_options``/``decode_options`` (one
    role's engine options) and ``EngineConfig``'s options for every engine."""
    return simulate_pd_run(workload, profile, layout, replicas, slo, policy=policy, link=link, **options)[0]


def max_goodput_rate(workload: list[BenchRequest], rates, slo: dict, profile="cpu", target: float = 0.9,
                     burstiness: float = 1.0, seed: int = 0, refine: int = 0, **options) -> dict:
    """DistServe's goodput: the highest offered rate at which at least ``target`` of the requests meet ``slo``.

    The workload's requests are re-timed at each rate of the grid ``rates`` (``with_gamma_arrivals``: the same
    gaps, scaled, so only the load changes) and served by ``simulate_pd(..., **options)``. ``goodput_rate``: the
    highest grid rate at or above ``target``; with ``refine`` > 0, that many bisection steps between it and the
    next grid rate (which failed) narrow it. ``monotone``: attainment never rose with the rate on the grid (if
    False, read the table, not the one number). Returns the table (``rates``, ``attainment``, P99 TTFT/TPOT)."""
    def attainment(rate):
        s = simulate_pd(with_gamma_arrivals(workload, rate, burstiness, seed), profile, slo=slo, **options)
        return s["slo_attainment"], s
    rates = sorted(rates)
    rows = [(r, *attainment(r)) for r in rates]
    ok = [i for i, (_, a, _) in enumerate(rows) if a >= target]
    best = rates[ok[-1]] if ok else 0.0
    if ok and refine and ok[-1] + 1 < len(rates):
        low, high = best, rates[ok[-1] + 1]
        for _ in range(refine):
            mid = (low + high) / 2
            low, high = (mid, high) if attainment(mid)[0] >= target else (low, mid)
        best = low
    atts = [a for _, a, _ in rows]
    return {"target": target, "slo": dict(slo), "goodput_rate": best, "rates": rates, "attainment": atts,
            "monotone": all(b <= a for a, b in zip(atts, atts[1:])),
            "p99_ttft_ms": [s["p99_ttft_ms"] for _, _, s in rows],
            "p99_tpot_ms": [s["p99_tpot_ms"] for _, _, s in rows],
            "simulated": True, "profile": rows[0][2]["profile"], "layout": rows[0][2]["layout"]}


REAL_KEYS = {"p50_ttft_ms": "median_ttft_ms", "p50_tpot_ms": "median_tpot_ms", "p50_latency_ms": "median_e2el_ms",
             "output_throughput": "output_throughput", "p99_itl_ms": "p99_itl_ms"}  # ours -> bench serve's


def workload_of(result) -> list[BenchRequest]:
    """The requests of a real ``bench serve`` run (a ``BenchResult``, ``ignore_eos``) as a simulated workload: the
    same send times, prompt lengths and answer lengths; prompts of distinct ids (no prefix is shared)."""
    sent = [r for r in result.requests if r.success]
    t0 = min((r.start_time for r in sent), default=0.0)
    return [BenchRequest(r.start_time - t0, [1000 + (i * 7919 + j) % 30000 for j in range(r.prompt_len)],
                         r.output_tokens, f"real{i}") for i, r in enumerate(sent)]


def predict_real_run(result, profile, layout: str = "1P1D", **options) -> dict:
    """A real run (chapter 07's ``experiments.disaggregation.run``: a ``BenchResult``) beside the simulation of
    its own requests, sent when they were: ``measured``, ``predicted`` (P50 TTFT, TPOT and latency, output
    throughput, P99 ITL) and ``error``, relative as ``validate.relative_errors`` (plus ``itl_p99``). Give the
    ``profile`` fitted where the workers ran (a worker pinned to one core steps slower than a two-core fit) and the
    ``link`` the chapter measured (``transfer_costs``' GB/s); ``options`` as ``simulate_pd``'s."""
    from .validate import relative_errors
    measured = {ours: result.summary[theirs] for ours, theirs in REAL_KEYS.items()}
    s = simulate_pd(workload_of(result), profile, layout, **options)
    predicted = {k: s[k] for k in REAL_KEYS}
    error = relative_errors(measured, predicted)
    error["itl_p99"] = (predicted["p99_itl_ms"] - measured["p99_itl_ms"]) / measured["p99_itl_ms"] \
        if measured["p99_itl_ms"] else math.nan
    return {"simulated": True, "profile": s["profile"], "layout": s["layout"], "requests": s["requests"],
            "measured": measured, "predicted": predicted, "error": error}


def long_short_workload(num_requests: int, rate: float, short_in: int, short_out: int, long_in: int,
                        long_out: int | None = None, long_every: int = 8, burstiness: float = 1.0,
                        seed: int = 0) -> list[BenchRequest]:
    """Chapter 07's mix at any scale: one request in ``long_every`` a ``long_in``-token prompt (``long-i``), the
    rest ``short_in`` tokens (``short-i``), sent as a gamma process at ``rate`` per second (Poisson at
    ``burstiness`` 1). Prompts of random token ids below 30,000 (inside any vocabulary the course loads): a
    simulated engine reads lengths, and no two share a prefix. Answers ``short_out`` tokens (``long_out``, default the same, for the long ones)."""
    import numpy as np

    from ..bench.serving.serve_datasets import arrival_gaps
    rng = np.random.default_rng(seed)
    times = np.cumsum(arrival_gaps(num_requests, rate, burstiness, rng))
    out = []
    for i, t in enumerate(times):
        long_ = i % long_every == long_every // 2
        ids = rng.integers(100, 30_000, long_in if long_ else short_in).tolist()
        out.append(BenchRequest(float(t), ids, (long_out or short_out) if long_ else short_out,
                                f"{'long' if long_ else 'short'}-{i}"))
    return out


def judge(outputs, slo: dict, max_prompt_len: int | None = None):
    """SLO attainment (a ``measure.Share``) of the requests with prompts shorter than ``max_prompt_len`` (all with
    None). ``slo`` in ms: ``ttft``; ``tpot``, a request's mean gap after its first token (DistServe's TPOT);
    ``itl``, its longest gap (a stutter a streaming reader sees)."""
    from ..measure import share_interval
    measures = {"ttft": lambda o: o.metrics.ttft,
                "tpot": lambda o: (o.metrics.latency - o.metrics.ttft) / max(len(o.token_ids) - 1, 1),
                "itl": lambda o: max(o.metrics.itl, default=0.0)}
    unknown = set(slo) - set(measures)
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)}: use {sorted(measures)}")
    judged = [o for o in outputs if max_prompt_len is None or len(o.prompt_token_ids) < max_prompt_len]
    good = sum(all(measures[k](o) * 1000 <= v for k, v in slo.items()) for o in judged)
    return share_interval(good, len(judged))


def slo_grid(cells: dict, layouts: dict, slos: dict, profile, max_prompt_len: int | None = None,
             progress=None, again: tuple[str, dict] | None = None, **options) -> dict:
    """Every cell's workload (``{cell: [BenchRequest]}``) through every layout (``{name: simulate_pd's layout
    arguments}``, e.g. ``{"colocated x2": {"layout": "colocated", "replicas": 2}, "1P1D": {"layout": "1P1D"}}``),
    judged by every SLO (``{slo name: judge's slo}``): ``{cell: {layout: {slo name: Share, "gaps_ms": the judged
    requests' gaps (ms)}}}``. ``options``: ``simulate_pd``'s, for every layout. ``progress``: a tqdm-like
    wrapper for the cells. ``again``: ``(layout name, {cell: workload on other arrivals})``: that layout runs a
    second time per cell, as ``"<name> (again)"``, the A/A pair ``crossover`` reads its verdicts against."""
    if "gaps_ms" in slos:
        raise ValueError("'gaps_ms' names the judged requests' gaps in each entry: give the SLO another name")
    grid = {}
    for cell, workload in (progress or (lambda x, **_: x))(list(cells.items()), desc="simulated cells"):
        grid[cell] = {}
        runs = [(name, layout, workload) for name, layout in layouts.items()]
        if again is not None:
            runs.append((again[0] + AGAIN, layouts[again[0]], again[1][cell]))
        for name, layout, workload in runs:
            _, _, outputs = simulate_pd_run(workload, profile, **{**options, **layout})
            judged = [o for o in outputs if max_prompt_len is None or len(o.prompt_token_ids) < max_prompt_len]
            grid[cell][name] = {**{s: judge(outputs, slo, max_prompt_len) for s, slo in slos.items()},
                                "gaps_ms": [g * 1000 for o in judged for g in o.metrics.itl]}
    return grid


def crossover(grid: dict, slo: str, split: str, together: str) -> dict:
    """Each cell of ``slo_grid`` called ``"split"`` (``split``'s attainment interval lies wholly above
    ``together``'s), ``"together"`` (below) or ``"level"`` (the intervals overlap): ``{cell: word}``. Where the grid
    ran ``together`` again on other arrivals (``slo_grid``'s ``again``), the gap must also exceed that A/A pair's."""
    from ..measure import share_verdict
    again = together + AGAIN
    return {cell: share_verdict(row[together][slo], row[split][slo], "split", "together",
                                aa=(row[together][slo], row[again][slo]) if again in row else None)
            for cell, row in sorted(grid.items())}


def goodput_rates(grid: dict, slo: str, name: str, target: float = 0.9) -> dict:
    """DistServe's goodput from a ``(length, rate)`` grid: per length, the highest rate at which ``name`` kept at
    least ``target`` of the judged requests inside ``slo``, every lower rate of the grid too (0.0: not even the
    lowest). Judged on the shares' point values: where a share's interval straddles ``target``, the goodput could
    be the grid's next rate either way."""
    from ..measure import goodput_rate
    out = {}
    for length in sorted({c[0] for c in grid}):
        rates = sorted(c[1] for c in grid if c[0] == length)
        out[length] = goodput_rate(rates, [grid[(length, rate)][name][slo] for rate in rates], target) or 0.0
    return out
