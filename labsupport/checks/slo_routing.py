"""Check for chapter 08: ``choose_worker``, an SLO-aware routing decision, and its measurement.

``fn(prompt_tokens, loads, slo_ttft_s) -> url | None`` gets a request's prompt length, one
``routing.WorkerLoad`` per healthy worker (what the router sent there and has not seen end, and how
fast the worker works through prompt tokens when every worker is busy) and the TTFT target. Its goal: every request gets the earliest
first token any worker can give it, and a request that no worker can start within the target is
refused at once (``None``: the router answers 429) instead of delaying everyone queued behind it.

``check_choose_worker`` first runs the function on hand-made situations, each built so that one
classic mistake picks the wrong worker (ignoring the prompt's own length, ignoring the queued work,
counting requests instead of tokens, always the first worker, never shedding, shedding what could
still make it), then on random ones. ``compare_routing`` then plugs it into chapter 07's router
(``routing.SLOAware``) in front of real servers, under bursty gamma arrivals, beside round robin
and least loaded, and measures each from the client's side: SLO attainment (the share of *all*
requests whose first token came within the target; a shed request counts as missed) and goodput
(those requests per second).
"""
from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

from .. import measure
from ..pd.routing import WorkerLoad
from .base import CheckFailed, passed


def predicted_ttft(load: WorkerLoad, prompt_tokens: int) -> float:
    """The worker prefills what was sent before, then this prompt, at its lone speed."""
    return (load.queued_tokens + prompt_tokens) * load.s_per_token


@dataclass
class Situation:
    what: str  # the mistake this situation catches, as the message says it
    prompt_tokens: int
    loads: list
    slo_ttft_s: float = 1.0


def _w(name, queued, s_per_token=0.002, in_flight=None):
    return WorkerLoad(f"http://{name}", queued, in_flight if in_flight is not None else (1 if queued else 0), s_per_token)


SITUATIONS = [
    Situation("the first worker has work queued and the second is idle: did you count each worker's queued tokens?",
              100, [_w("a", 600), _w("b", 0)]),
    Situation("one long request in flight on the first worker, three short ones on the second: did you compare "
              "queued tokens, not requests in flight?", 100, [_w("a", 450, in_flight=1), _w("b", 60, in_flight=3)]),
    Situation("a fast worker with a queue beside a slow idle one, and a long prompt: the slow worker would take "
              "400 tokens x 4 ms; did you add the prompt's own tokens at each worker's speed?",
              400, [_w("fast", 300, 0.001), _w("slow", 0, 0.004)]),
    Situation("both workers are too busy for this prompt: no first token can come within the target, so shed "
              "it (return None)", 300, [_w("a", 500), _w("b", 450)]),
    Situation("an idle worker can just make it (0.9 s of a 1.0 s target): serve it, shed only what no worker can "
              "start in time", 450, [_w("a", 0), _w("b", 200)]),
    Situation("a short prompt fits on both workers even though the long one would not: did you use the prompt's "
              "length when deciding to shed?", 20, [_w("a", 480), _w("b", 470)]),
    Situation("the target is met exactly (0.20 s of a 0.20 s target): within means <=", 100,
              [_w("a", 0)], 0.2),
]


def _random_situation(rng: random.Random) -> Situation:
    loads = [_w(f"w{i}", rng.choice([0, rng.randrange(0, 1200)]), rng.choice([0.001, 0.002, 0.004]),
                rng.randrange(0, 5)) for i in range(rng.randrange(1, 5))]
    return Situation("a random situation", rng.choice([16, 64, 200, 500]), loads, rng.choice([0.5, 1.0, 2.0]))


def _describe(s: Situation) -> str:
    workers = "; ".join(f"{w.url.removeprefix('http://')}: {w.queued_tokens} tokens queued in {w.in_flight} "
                        f"requests, {w.s_per_token * 1000:g} ms/token -> {predicted_ttft(w, s.prompt_tokens):.2f} s"
                        for w in s.loads)
    return f"a {s.prompt_tokens}-token prompt, target {s.slo_ttft_s:g} s, workers [{workers}]"


def _judge(fn, s: Situation):
    loads = list(s.loads)
    given = copy.deepcopy(loads)
    try:
        got = fn(s.prompt_tokens, given, s.slo_ttft_s)
    except Exception as exc:
        raise CheckFailed(f"your function raised {type(exc).__name__}: {exc} on {_describe(s)}") from exc
    if given != loads:
        raise CheckFailed(f"your function changed the list of loads it was given ({_describe(s)}): the router "
                          "reuses it; sort a copy")
    times = {w.url: predicted_ttft(w, s.prompt_tokens) for w in loads}
    best = min(times.values())
    fits = best <= s.slo_ttft_s * (1 + 1e-9)
    if got is None:
        if fits:
            raise CheckFailed(f"you shed a request that a worker could start in {best:.2f} s, within the target. "
                              f"{s.what} ({_describe(s)})")
        return
    if got not in times:
        raise CheckFailed(f"you returned {got!r}, which is neither None nor a worker's url ({_describe(s)})")
    if not fits:
        raise CheckFailed(f"you sent the request to {got.removeprefix('http://')}, where its first token would come "
                          f"after {times[got]:.2f} s, beyond the {s.slo_ttft_s:g} s target, and so would it "
                          f"anywhere: {s.what} ({_describe(s)})")
    if times[got] > best * (1 + 1e-9):
        raise CheckFailed(f"you chose {got.removeprefix('http://')} ({times[got]:.2f} s to the first token) where "
                          f"another worker gives it in {best:.2f} s: {s.what} ({_describe(s)})")


def check_choose_worker(fn, random_situations: int = 300):
    """``fn`` on ``SITUATIONS`` (each catches one mistake) and on random situations, against the goal: the least
    predicted TTFT, or None exactly when no worker meets the target."""
    for s in SITUATIONS:
        _judge(fn, s)
    rng = random.Random(8)
    for _ in range(random_situations):
        _judge(fn, _random_situation(rng))
    passed(f"choose_worker sent each request where its first token comes soonest, counted queued tokens and the "
           f"prompt's own at each worker's speed, and shed exactly what no worker could start within the target "
           f"({len(SITUATIONS)} situations built to catch one mistake each, {random_situations} random ones)")


# ---------------------------------------------------------------- the measurement, through the real router

@dataclass
class RoutingLoad:
    """The bursty load of the comparison, sized from what the workers sustain together on this machine.

    Calibration measures two speeds per worker. Its *lone* TTFT of a long prompt sets the target (``slo_factor``
    times the slower worker's). Its *sustained* seconds per prompt token come from a burst of the load's own mix
    sent to every worker at once: decode steps, HTTP and scheduling overheads, and the workers sharing the
    machine's cores are all in it, so a long prompt alone is a poor guide to how fast a queue drains. Both the
    offered rate (``load`` times the requests per second the workers sustain) and the speeds the SLO-aware
    policy predicts with are the sustained ones. Bursts (gamma shape below 1) bring several requests at once:
    above one, a policy that serves everything builds a queue, and some requests miss the target."""

    num_requests: int = 30
    long_len: int = 256  # prompt tokens of a long request ...
    short_len: int = 32  # ... and of a short one
    long_share: float = 0.3
    output_len: int = 8
    burstiness: float = 0.3  # gamma shape: 1 is Poisson, below 1 burstier
    load: float = 1.5  # offered requests per second / what the workers sustained together in calibration
    slo_factor: float = 3.0  # TTFT target = this x the slower worker's lone TTFT of a long prompt
    calibration_burst: int = 8  # requests of the mix sent to each worker at once to measure its sustained speed
    seed: int = 0

    def lengths(self, num_requests: int, seed: int) -> list[int]:
        """``num_requests`` prompt lengths, ``long_share`` of them long, in a seeded order."""
        longs = round(self.long_share * num_requests)
        lengths = [self.long_len] * longs + [self.short_len] * (num_requests - longs)
        random.Random(seed).shuffle(lengths)
        return lengths


def _prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    """Random token ids (the tokenizer's ordinary ones), fresh per run: no prefix-cache hit helps any policy."""
    from ..bench.serving.serve_datasets import _ordinary_ids
    rng = random.Random(seed)
    vocab = _ordinary_ids(tokenizer).tolist()
    return [[rng.choice(vocab) for _ in range(n)] for n in lengths]


def _lone_ttft(url: str, model: str, prompt: list[int]) -> float:
    from ..bench.serving.serve_bench import COMPLETIONS, benchmark
    from ..bench.serving.serve_datasets import SampleRequest
    r = benchmark(url, model, [SampleRequest(prompt, len(prompt), 1)], endpoint=COMPLETIONS, progress=False,
                  test_request=False)
    if not r.requests[0].success:
        raise RuntimeError(f"{url}: {r.requests[0].error}")
    return r.requests[0].ttft


def _sustained(urls: list[str], model: str, tokenizer, load: RoutingLoad) -> dict[str, float]:
    """Seconds per prompt token each worker sustains while every worker serves a burst of the mix at once."""
    from concurrent.futures import ThreadPoolExecutor

    from ..bench.serving.serve_bench import COMPLETIONS, benchmark
    from ..bench.serving.serve_datasets import SampleRequest
    lengths = load.lengths(load.calibration_burst, load.seed + 2000)

    def burst(i_url):
        i, url = i_url
        requests = [SampleRequest(p, len(p), load.output_len)
                    for p in _prompts(tokenizer, lengths, load.seed + 3000 + i)]
        r = benchmark(url, model, requests, endpoint=COMPLETIONS, progress=False, test_request=False)
        failed = [q.error for q in r.requests if not q.success]
        if failed:
            raise RuntimeError(f"{url}: {len(failed)} calibration requests failed, first: {failed[0]}")
        return url, r["duration"] / sum(lengths)

    with ThreadPoolExecutor(len(urls)) as pool:
        return dict(pool.map(burst, enumerate(urls)))


def calibrate(urls: list[str], model: str, tokenizer, load: RoutingLoad) -> dict:
    """Each worker's lone TTFT of a long prompt (after one warm-up), the target it sets, and each worker's sustained
    seconds per prompt token with every worker busy (``_sustained``)."""
    lone = {}
    for i, url in enumerate(urls):
        warm, *probes = _prompts(tokenizer, [load.short_len, load.long_len, load.long_len], load.seed + 1000 + i)
        _lone_ttft(url, model, warm)  # a server's first requests are slower: not the one measured
        lone[url] = min(_lone_ttft(url, model, p) for p in probes)
    return {"lone_ttft_s": lone, "s_per_token": _sustained(urls, model, tokenizer, load),
            "slo_ttft_s": load.slo_factor * max(lone.values())}


def compare_routing(choose_worker, urls: list[str], names: list[str], model: str, tokenizer,
                    load: RoutingLoad = RoutingLoad()) -> dict:
    """Round robin, least loaded and ``SLOAware(choose_worker)`` behind chapter 07's router (in-process) in front of
    ``urls``, each under the same bursty load (same lengths and arrival times, fresh tokens); prints the table and
    returns it. Raises ``CheckFailed`` if the attendee's policy broke a request in the router (a 500), and
    ``RuntimeError`` if a server failed under the load (the policy's fault or not, the comparison would be void)."""
    from ..bench.serving.serve_bench import COMPLETIONS, benchmark
    from ..bench.serving.serve_datasets import SampleRequest
    from ..pd.router_app import create_router_app
    from ..pd.routing import SLOAware
    from ..serve.background import BackgroundServer

    cal = calibrate(urls, model, tokenizer, load)
    slo, spt = cal["slo_ttft_s"], cal["s_per_token"]
    lengths = load.lengths(load.num_requests, load.seed)
    capacity = sum(1 / (s * sum(lengths) / len(lengths)) for s in spt.values())  # requests/s the workers sustain
    rate = load.load * capacity
    policies = [("round robin", "round_robin"), ("least loaded", "least_loaded"), ("your SLO-aware", None)]
    rows = []
    for k, (label, name) in enumerate(policies):
        policy = name or SLOAware(choose_worker, slo, spt)
        requests = [SampleRequest(p, len(p), load.output_len) for p in _prompts(tokenizer, lengths, load.seed + k)]
        with BackgroundServer(create_router_app(instances=urls, policy=policy, health_interval=30.0,
                                                 read_timeout=600.0)) as router:
            r = benchmark(router.url, model, requests, rate=rate, burstiness=load.burstiness, endpoint=COMPLETIONS,
                          progress=False, seed=load.seed, test_request=False)
        shed = [q for q in r.requests if q.error.startswith("HTTP 429")]
        broken = [q.error for q in r.requests if not q.success and q not in shed]
        if broken and name is None and any(e.startswith("HTTP 500") for e in broken):  # the router's answer to a raise
            raise CheckFailed(f"your policy broke {len(broken)} requests in the router (it raised, or returned a url "
                              f"that is not a worker's): {broken[0]}")
        if broken:
            raise RuntimeError(f"{label}: {len(broken)} requests failed other than by shedding, first: {broken[0]}")
        good = [q for q in r.requests if q.success and q.ttft <= slo]
        late = [q for q in r.requests if q.success and q.ttft > slo]
        rows.append({"policy": label, "attainment": len(good) / len(requests), "goodput_req_s": len(good) / r["duration"],
                     "within": len(good), "late": len(late), "shed": len(shed), "requests": len(requests),
                     "p90_ttft_s": r["p90_ttft_ms"] / 1000, "duration_s": r["duration"]})
    lone = ", ".join(f"{n} {cal['lone_ttft_s'][u] * 1000:.0f} ms" for n, u in zip(names, urls))
    sustained = ", ".join(f"{n} {spt[u] * 1000:.1f} ms" for n, u in zip(names, urls))
    print(f"lone TTFT of a {load.long_len}-token prompt: {lone}; target TTFT {slo * 1000:.0f} ms "
          f"({load.slo_factor:g}x the slower); sustained per prompt token, all workers busy: {sustained}")
    print(f"{load.num_requests} requests ({sum(x == load.long_len for x in lengths)} of {load.long_len} tokens, the "
          f"rest {load.short_len}), {load.output_len} tokens out, gamma arrivals of shape {load.burstiness:g} at "
          f"{rate:.2f} req/s ({load.load:g}x the {capacity:.2f} req/s the workers sustained)")
    print(f"{'policy':16} {'within target':>14} {'attainment':>11} {'goodput':>12} {'late':>5} {'shed':>5} "
          f"{'TTFT P90 of served':>19}")
    for row in rows:
        print(f"{row['policy']:16} {row['within']:>6} of {row['requests']:<5} {100 * row['attainment']:>9.0f} % "
              f"{row['goodput_req_s']:>6.2f} req/s {row['late']:>5} {row['shed']:>5} {row['p90_ttft_s'] * 1000:>14.0f} ms")
    return {"rows": rows, "calibration": cal, "rate_req_s": rate, "lengths": lengths}


def verdict(result: dict, threshold: float = 0.9) -> str:
    """What the table shows, in words, through the measurement discipline: each baseline's share of requests within
    the target against the attendee's, a word ("more", "fewer") only when their 95 % intervals part, else "level
    with"; and which policies fell below the threshold."""
    from ..measure import share_interval, share_verdict
    rows = {r["policy"]: r for r in result["rows"]}
    mine = rows["your SLO-aware"]
    share = {name: share_interval(r["within"], r["requests"]) for name, r in rows.items()}

    def against(name):
        r = rows[name]
        word = share_verdict(share[name], share["your SLO-aware"], "more requests within the target than",
                             "fewer requests within the target than")
        word = "a share within the target level with" if word == "level" else word
        return (f"{word} {name} ({share['your SLO-aware']} against {share[name]}; goodput "
                f"{mine['goodput_req_s']:.2f} against {r['goodput_req_s']:.2f} req/s)")

    below = [r["policy"] for r in result["rows"] if r["attainment"] < threshold]
    return (f"Your SLO-aware policy got {against('round robin')}, and {against('least loaded')}, shedding "
            f"{mine['shed']} of {mine['requests']}. Below {100 * threshold:.0f} % attainment: "
            f"{', '.join(below) if below else 'none'}.")


AGAIN = "round robin" + measure.AGAIN  # simulated_routing's A/A row: round robin on other arrivals of the same mix
OTHER_ARRIVALS = 4000  # added to the load's seed for that row's arrivals and order


def simulated_routing(choose_worker, profile, load: RoutingLoad, replicas: int = 2, again: bool = True,
                      **engine_options) -> dict:
    """``compare_routing``'s experiment on a simulated clock (``labsupport.sim``): ``replicas`` simulated engines of
    ``profile`` behind the router's own policies — round robin, least loaded and ``SLOAware(choose_worker)``, the
    attendee's function unchanged — with the same calibration (each engine's lone TTFT of a long prompt sets the
    target; seconds per prompt token sustained in a burst of the mix, every engine busy), the same offered rate
    (``load.load`` times what they sustain) and gamma arrivals, at a request count two cores cannot reach in real
    time. Every policy sees the same arrivals; with ``again``, a fourth row (``AGAIN``) runs round robin once more on
    other arrivals of the same mix: the A/A pair whose gap a verdict between policies must exceed
    (``measure.share_verdict``'s ``aa``), since requests queued together are not independent trials.
    Returns ``compare_routing``'s dict (rows, calibration, rate) plus ``"simulated": True`` and the profile."""
    from ..bench.offline.workload import BenchRequest
    from ..pd.routing import SLOAware
    from ..sim.pd_cluster import Cluster
    from ..sim.simulate import with_gamma_arrivals

    def requests(lengths, seed, out):
        rng = random.Random(seed)
        return [BenchRequest(0.0, [rng.randrange(100, 30_000) for _ in range(n)], out, f"q{i}")
                for i, n in enumerate(lengths)]

    def run(workload, policy="round_robin", engines=replicas):
        cluster = Cluster(profile, "colocated", engines, policy=policy, **engine_options)
        outputs, duration = cluster.run(workload)
        return cluster, outputs, duration

    _, (lone,), _ = run(requests([load.long_len], load.seed + 1000, 1), engines=1)
    lengths_cal = load.lengths(load.calibration_burst * replicas, load.seed + 2000)
    _, _, burst_s = run(requests(lengths_cal, load.seed + 3000, load.output_len))  # every engine busy at once
    names = [f"replica-{k}" for k in range(replicas)]
    spt = {n: burst_s * replicas / sum(lengths_cal) for n in names}  # identical engines: the burst's average each
    slo = load.slo_factor * lone.metrics.ttft
    lengths = load.lengths(load.num_requests, load.seed)
    capacity = sum(1 / (s * sum(lengths) / len(lengths)) for s in spt.values())
    rate = load.load * capacity
    rows = []
    runs = [("round robin", "round_robin"), ("least loaded", "least_loaded"), ("your SLO-aware", None)]
    for k, (label, name) in enumerate(runs + ([(AGAIN, "round_robin")] if again else [])):
        policy = name or SLOAware(choose_worker, slo, spt)
        arrivals = load.seed if label != AGAIN else load.seed + OTHER_ARRIVALS  # the A/A run: other arrivals, order
        order = lengths if label != AGAIN else load.lengths(load.num_requests, load.seed + OTHER_ARRIVALS)
        workload = with_gamma_arrivals(requests(order, load.seed + k, load.output_len), rate, load.burstiness,
                                       arrivals)
        cluster, outputs, duration = run(workload, policy)
        shed = sum(t.shed for t in cluster.traces.values())
        ttfts = sorted(o.metrics.ttft for o in outputs)
        within = sum(t <= slo for t in ttfts)
        rows.append({"policy": label, "attainment": within / len(workload), "goodput_req_s": within / duration,
                     "within": within, "late": len(ttfts) - within, "shed": shed, "requests": len(workload),
                     "p90_ttft_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else math.nan,
                     "duration_s": duration})
    return {"rows": rows, "rate_req_s": rate, "lengths": lengths, "simulated": True, "profile": profile,
            "calibration": {"lone_ttft_s": {n: lone.metrics.ttft for n in names}, "s_per_token": spt,
                            "slo_ttft_s": slo}, "capacity_req_s": capacity}


def format_routing(result: dict, load: RoutingLoad) -> str:
    """``compare_routing``'s table for a result (the simulated one's too), as text."""
    cal, rows = result["calibration"], result["rows"]
    lines = [f"target TTFT {cal['slo_ttft_s'] * 1000:.0f} ms ({load.slo_factor:g}x a lone {load.long_len}-token "
             f"prompt's); {len(result['lengths'])} requests ({sum(x == load.long_len for x in result['lengths'])} of "
             f"{load.long_len} tokens, the rest {load.short_len}), {load.output_len} tokens out, gamma arrivals of "
             f"shape {load.burstiness:g} at {result['rate_req_s']:.2f} req/s",
             f"{'policy':19} {'within target':>14} {'attainment (95 % interval)':>27} {'goodput':>12} {'late':>5} "
             f"{'shed':>5}"]
    from ..measure import share_interval
    for row in rows:
        s = share_interval(row["within"], row["requests"])
        lines.append(f"{row['policy']:19} {row['within']:>6} of {row['requests']:<5} {100 * s.value:>9.0f} % "
                     f"({100 * s.low:3.0f}-{100 * s.high:3.0f} %)   {row['goodput_req_s']:>8.2f} req/s {row['late']:>5} "
                     f"{row['shed']:>5}")
    return "\n".join(lines)
