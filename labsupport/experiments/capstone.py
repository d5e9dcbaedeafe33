"""Capstone: the whole course engine against transformers and vLLM on five kinds of traffic, read as a decision.

Each column is a server started on this machine and driven over HTTP by ``bench serve``'s client, one at a
time, with the same requests (chapter 06's load generator, ``serve_datasets``):

* ``all``: our engine with every technique of the course on (paged KV, continuous batching, prefix caching,
  chunked prefill, n-gram speculative decoding, int8 weights);
* ``all - X``: the same with one technique off, for each X: what X buys is ``all`` against ``all - X``;
* ``transformers serve --continuous-batching`` (Hugging Face's own OpenAI server, in the mode that was the
  faster of its two under concurrent load here: ``benchmarks/README.md``) and ``vllm serve``, both fp32.

Each row is a kind of traffic, with the metric its users feel (``Traffic.headline``): short chat (capacity:
output tokens/s, hence $ per million tokens), long-document RAG (long unique prompts among chats, Poisson:
SLO attainment: the long prompts' TTFT and the TPOT of everyone decoding beside them), a shared system
prompt (capacity), bursty load (gamma arrivals: SLO attainment) and long reasoning outputs (few users,
long worked answers: the time to the whole answer, P50). The decision table says, per traffic,
which techniques pay, which cost, and which do nothing measurable; the full table keeps throughput, TTFT,
TPOT and tails side by side, because they pull against each other.

Every cell is one run, and every cell keeps each request's figures (``per_request``: the same requests, in the same
order, in every column), so the decision follows ``labsupport.measure``: ``all`` is measured twice, first and last
(``all (again)``), and that pair, request by request, gives each traffic's A/A band (``bands``); a technique
"pays" or "costs", and ours is "ahead" of or "behind" transformers and vLLM, only where the bootstrap interval of
the ratio, paired by request, lies outside that band, else "level". A run saved without per-request figures
(an older run) or without ``all (again)`` gets ratios only, one run each, and no verdict; so does every traffic
sent all at once (short chat, shared system prompt, long reasoning), whose requests move together: one run a
column is one sample there, and a band over runs needs three runs of every column.

    python -m labsupport bench capstone --json labsupport/data/capstone_cpu.json --plot benchmarks/capstone.png

``transformers serve`` has no ``ignore_eos``: its requests may stop early, and its rates count the tokens it
sent. Everything else is forced to each request's length. One price ($/hour) for the machine, every column.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

from ..measure import Band, noise_band, verdict

TECHNIQUES = {  # name -> the serve flags that turn it OFF (from ``all``)
    "continuous batching": ("scheduling_policy", "static"),
    "prefix caching": ("enable_prefix_caching", False),
    "chunked prefill": ("enable_chunked_prefill", False),
    "speculative decoding": ("speculative", False),
    "int8 weights": ("quantization", None),
}
ALL = dict(scheduling_policy="continuous", enable_prefix_caching=True, enable_chunked_prefill=True,
           speculative=True, quantization="int8")
AGAIN = "all (again)"  # ``all`` once more, after every other server: how far two runs of the same work differ
# A headline is one figure per run; the verdict reads the per-request figure behind it: (sample, statistic,
# whether higher is better). Capacity (output tokens/s) is judged on each request's time per output token, send
# to last token, which the batch's throughput sets.
SAMPLES = {"output_tok_s": ("ms_per_token", "mean", False), "slo_attainment": ("slo_met", "mean", True),
           "e2el_p50_ms": ("e2el_ms", "median", False), "tpot_p50_ms": ("tpot_ms", "median", False)}


@dataclass(frozen=True)
class Traffic:
    name: str
    dataset: str  # serve_datasets: random, shared-prefix, long-short; or "reasoning" (REASONING's questions)
    num_requests: int
    input_len: int
    output_len: int
    rate: float = math.inf  # requests/s; inf: all at once (capacity)
    burstiness: float = 1.0
    prefix_len: int = 0
    long_input_len: int = 0
    num_long: int = 0
    headline: str = "output_tok_s"  # the metric its users feel (load_run's keys); higher is better except *_ms
    ttft_ms: float = 3000.0  # the SLO
    tpot_ms: float = 250.0
    why: str = ""


REASONING = [  # questions whose answers are long worked solutions (a reasoning model's traffic, small)
    "A train leaves at 3 pm and travels at 60 km/h for 2.5 hours, then at 80 km/h for 1.5 hours. How far does "
    "it travel in total? Think step by step and show every calculation.",
    "A shop sells pens at 3 for $2 and notebooks at $4 each. Ana buys 12 pens and 5 notebooks and pays with a "
    "$50 note. How much change does she get? Reason step by step.",
    "Prove that the sum of two odd numbers is even. Explain each step of the proof carefully.",
    "A rectangle has a perimeter of 36 cm and its length is twice its width. Find its area. Work through it "
    "step by step, checking the answer at the end.",
]


def traffics(scale: float = 1.0) -> list[Traffic]:
    """The five kinds of traffic, sized for a short run of each server on 2 CPU cores, each within this
    machine's capacity so that the SLOs mean something (``scale`` multiplies the request counts: 0.25 for a
    quick look, 4 or more on a GPU)."""
    n = lambda k: max(2, round(k * scale))  # noqa: E731
    return [
        Traffic("short chat", "random", n(16), 64, 32, why="many short turns at once: capacity, so $/Mtok"),
        Traffic("long-document RAG", "long-short", n(10), 48, 24, rate=0.75, long_input_len=512, num_long=max(1, n(2)),
                headline="slo_attainment", ttft_ms=4000, tpot_ms=300,
                why="long unique prompts among chats: their prefills stall the others' decoding"),
        Traffic("shared system prompt", "shared-prefix", n(16), 32, 24, prefix_len=384,
                why="one long system prompt before every question: recomputed or shared"),
        Traffic("bursty load", "random", n(24), 64, 16, rate=1.5, burstiness=0.3, headline="slo_attainment",
                ttft_ms=2000, tpot_ms=300, why="gamma arrivals of shape 0.3 at 1.5 req/s: queues form and drain"),
        Traffic("long reasoning", "reasoning", n(4), 0, 256, headline="e2el_p50_ms",
                why="few users, long worked answers: decode dominates; users wait for the whole answer"),
    ]


def columns() -> list[dict]:
    """Servers to measure: ours with everything, ours with each technique off, transformers, vLLM."""
    cols = [{"name": "all", "kind": "ours", "config": dict(ALL)}]
    for tech, (key, off) in TECHNIQUES.items():
        cols.append({"name": f"all - {tech}", "kind": "ours", "config": {**ALL, key: off}, "without": tech})
    cols.append({"name": "transformers serve", "kind": "transformers", "config": {"continuous_batching": True}})
    cols.append({"name": "vllm serve", "kind": "vllm", "config": {}})
    cols.append({"name": AGAIN, "kind": "ours", "config": dict(ALL), "repeat_of": "all"})
    return cols


@dataclass(frozen=True)
class Sizes:
    max_num_seqs: int = 16
    block_size: int = 32
    kv_tokens: int = 8192
    max_model_len: int = 1024
    chunk_tokens: int = 128  # max_num_batched_tokens with chunked prefill (ours and vLLM)
    spec_k: int = 4


def server_args(col: dict, s: Sizes, kv_bytes_per_token: int) -> list[str]:
    """``serve`` / ``vllm serve`` flags of a column."""
    if col["kind"] == "vllm":
        return ["--block-size", str(s.block_size), "--num-gpu-blocks-override", str(s.kv_tokens // s.block_size + 1),
                "--max-num-seqs", str(s.max_num_seqs), "--enable-prefix-caching", "--enable-chunked-prefill",
                "--max-num-batched-tokens", str(s.chunk_tokens)]
    if col["kind"] == "transformers":
        return ["--continuous-batching"] if col["config"].get("continuous_batching") else []
    c = col["config"]
    args = ["--kv-cache", "paged", "--scheduling-policy", c["scheduling_policy"], "--max-num-seqs", str(s.max_num_seqs),
            "--max-model-len", str(s.max_model_len), "--block-size", str(s.block_size),
            "--kv-cache-memory-bytes", str(s.kv_tokens * kv_bytes_per_token),
            "--enable-prefix-caching" if c["enable_prefix_caching"] else "--no-enable-prefix-caching"]
    # without chunking, a step still has a budget: it must hold the longest prompt whole
    args += ["--max-num-batched-tokens", str(s.chunk_tokens if c["enable_chunked_prefill"] else s.max_model_len)]
    args.append("--enable-chunked-prefill" if c["enable_chunked_prefill"] else "--no-enable-chunked-prefill")
    if c["speculative"]:
        args += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": s.spec_k,
                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    if c["quantization"]:
        args += ["--quantization", c["quantization"]]
    return args


def requests_of(t: Traffic, tokenizer, seed: int = 0):
    from ..bench.serving.serve_datasets import SampleRequest, sample_requests
    if t.dataset == "reasoning":
        texts = [REASONING[i % len(REASONING)] for i in range(t.num_requests)]
        return [SampleRequest(x, len(tokenizer.encode(x, add_special_tokens=False)), t.output_len) for x in texts]
    return sample_requests(tokenizer, t.dataset, t.num_requests, t.input_len, t.output_len, range_ratio=0.25,
                           prefix_len=t.prefix_len, num_long=t.num_long, long_input_len=t.long_input_len, seed=seed)


def start(col: dict, s: Sizes, folder: str, kv_bytes_per_token: int):
    """Start a column's server; return (process, base URL, the model name requests carry)."""
    from ..pd.cluster import Worker, start_all
    from ..servers import TransformersServer, VllmServer
    args = server_args(col, s, kv_bytes_per_token)
    if col["kind"] == "vllm":
        w = VllmServer(folder, args=args, max_model_len=s.max_model_len, kv_space_gib=1)
        start_all([w], 300)
        return w, w.url, w.served_name
    if col["kind"] == "transformers":
        w = TransformersServer(folder, continuous_batching=bool(col["config"].get("continuous_batching")))
        start_all([w], 300)
        return w, w.url, folder
    w = start_all([Worker(None, None, model=folder, args=[*args, "--served-model-name", "smol"])])[0]
    return w, w.url, "smol"


def measure_column(col: dict, loads: list, s: Sizes, folder: str, kv_bytes_per_token: int, usd_per_hour: float,
                   progress=None) -> dict:
    """Start the column, warm it on an unrelated prompt, run every traffic through it, stop it."""
    import httpx

    from ..pd.cluster import stop_all
    from .course_table import load_run
    t0 = time.perf_counter()
    out = {**col, "args": server_args(col, s, kv_bytes_per_token), "traffic": {}}
    proc, url, model = start(col, s, folder, kv_bytes_per_token)
    try:
        httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}).raise_for_status()
        for t, requests in loads:
            out["traffic"][t.name] = load_run(url, url, model, requests, t.rate, t.burstiness, t, usd_per_hour,
                                              seed=1, ignore_eos=col["kind"] != "transformers", per_request=True)
            if progress is not None:
                progress.update(1)
    finally:
        stop_all([proc])
    out["seconds"] = time.perf_counter() - t0
    return out


def _better(metric: str, on: float, off: float) -> float:
    """How many times better ``on`` is than ``off`` for this metric (> 1: better); nan when either is missing."""
    if on is None or off is None or not (on == on and off == off) or min(on, off) <= 0:
        return math.nan
    return off / on if metric.endswith("_ms") else on / off


def _cells(result: dict):
    cols = {c["name"]: c for c in result["columns"] if "traffic" in c}
    return lambda col, traffic: cols.get(col, {}).get("traffic", {}).get(traffic, {})


def samples(x: dict, metric: str) -> list[float | None] | None:
    """The per-request figure behind a cell's headline (``SAMPLES``), in request order; None for a cell saved
    without per-request figures."""
    pr = x.get("per_request")
    if not pr or metric not in SAMPLES:
        return None
    name = SAMPLES[metric][0]
    if name == "ms_per_token":
        return [e / n if e is not None and n else None for e, n in zip(pr["e2el_ms"], pr["output_tokens"])]
    return pr[name]


def _paired(a: list, b: list) -> tuple[list[float], list[float]]:
    """Request i of one column against request i of the other, dropping pairs where either failed."""
    keep = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and x == x and y == y]
    return [x for x, _ in keep], [y for _, y in keep]


AT_ONCE = "sent at once: one run a column is one sample"


def sent_at_once(traffic: dict) -> bool:
    """Whether a saved traffic sent every request at once (rate inf, saved as Infinity or "inf"); a file without
    a rate (older, or made by hand) is read as spread out."""
    rate = traffic.get("rate")
    return rate is not None and float(rate) == math.inf


def _band(result: dict, traffic: dict, seed: int = 0) -> tuple[Band | None, str]:
    """This traffic's A/A band (``all`` against ``all (again)``, paired by request), or None and why not.

    A traffic sent all at once has none: its requests share their engine steps and move together, so one run of
    a column is one sample, and a bootstrap over its requests reads chance as a difference (``labsupport.measure``,
    ``by="run"``: a band needs at least three runs of each column, which this one-run-a-column design lacks)."""
    if sent_at_once(traffic):
        return None, AT_ONCE
    cell, metric = _cells(result), traffic["headline"]
    first, again = samples(cell("all", traffic["name"]), metric), samples(cell(AGAIN, traffic["name"]), metric)
    if not cell(AGAIN, traffic["name"]):
        return None, "no all (again) column"
    if first is None or again is None:
        return None, "no per-request figures"
    a, b = _paired(first, again)
    if len(a) < 2:
        return None, "fewer than 2 requests answered in both runs"
    try:
        return noise_band(a, b, SAMPLES[metric][1], seed=seed, paired=True), ""
    except ValueError as exc:  # e.g. a mean of 0 in some resamples: every request missed its SLO
        return None, str(exc).split(":")[0]


def bands(result: dict) -> list[dict]:
    """Per traffic: the sample and statistic its verdicts read, and its A/A band (as numbers) or why there is
    none. A traffic without a band gets ratios, one run each, and no verdict."""
    out = []
    for t in result["traffics"]:
        band, why = _band(result, t)
        sample, stat, _ = SAMPLES.get(t["headline"], (None, None, None))
        out.append({"traffic": t["name"], "sample": sample, "stat": stat, "why_none": why,
                    "band": None if band is None else {"low": band.low, "high": band.high, "n": band.n}})
    return out


def _judge(result: dict, traffic: dict, on: str, off: str, words: tuple[str, str], band: Band | None,
           seed: int = 0) -> dict:
    """``on`` against ``off`` on the traffic's headline: the headline ratio ``x`` (> 1: ``on`` better) and, where
    the traffic has an A/A band (``band``) and both cells their per-request figures, the verdict: ``words[0]``
    ("pays") when the interval of the per-request ratio lies beyond the band on the better side, ``words[1]`` on
    the worse, "level" within; ``verdict`` None (one run each, no verdict) otherwise."""
    cell, name, metric = _cells(result), traffic["name"], traffic["headline"]
    out = {"x": _better(metric, cell(on, name).get(metric), cell(off, name).get(metric)), "verdict": None}
    a, b = samples(cell(off, name), metric), samples(cell(on, name), metric)
    if band is None or a is None or b is None:
        return out
    a, b = _paired(a, b)
    _, stat, higher_is_better = SAMPLES[metric]
    better, worse = words
    try:
        v = verdict(a, b, band, higher=better if higher_is_better else worse,
                    lower=worse if higher_is_better else better, higher_is_better=higher_is_better, stat=stat,
                    seed=seed, paired=True)
    except ValueError:  # too few answered pairs, or a statistic of 0 to divide by: no interval, no word
        return out
    return out | {"verdict": v.word, "interval": v.as_dict(), "phrase": v.describe()}


def decision(result: dict) -> list[dict]:
    """Per traffic: what each technique does to its headline (``all`` vs ``all - X``), and ``all`` against
    transformers and vLLM; a verdict word only from the discipline (``_judge``), else the ratio alone."""
    cell = _cells(result)
    rows = []
    for t in result["traffics"]:
        name, metric = t["name"], t["headline"]
        row = {"traffic": name, "headline": metric, "all": cell("all", name).get(metric), "techniques": {}}
        band, _ = _band(result, t)
        for tech in TECHNIQUES:
            judged = _judge(result, t, "all", f"all - {tech}", ("pays", "costs"), band)
            if tech == "prefix caching" and cell("all", name).get("prefix_cache_hit_rate") == 0:
                judged = {"x": judged["x"], "verdict": "idle"}  # nothing shared: whatever moved is not the cache
            row["techniques"][tech] = judged
        for other in ("transformers serve", "vllm serve"):
            key = other.split()[0]
            row[f"ours_vs_{key}"] = _judge(result, t, "all", other, ("ahead", "behind"), band)
            row[f"usd_per_mtok_{key}"] = cell(other, name).get("usd_per_mtok")
        row["usd_per_mtok_all"] = cell("all", name).get("usd_per_mtok")
        rows.append(row)
    return rows


def run(sizes: Sizes = Sizes(), scale: float = 1.0, which: tuple | None = None, usd_per_hour: float = 0.10,
        progress: bool = True, only: tuple | None = None) -> dict:
    """Measure the chosen columns (default: all that can run here) over the five traffics (``only``: those
    named); a JSON-able dict."""
    from tqdm.auto import tqdm

    from ..models.loader import resolve_model_path
    from ..servers import vllm_status
    from ..machine import machine
    from ..bench.lab.roofline import model_facts, other_runnable
    from ..bench.serving.serve_datasets import load_tokenizer
    folder = str(resolve_model_path(None))
    kv_per_token = model_facts(folder)["kv_bytes_per_token"]
    tok = load_tokenizer(None)
    ts = [t for t in traffics(scale) if only is None or t.name in only]
    if not ts:
        raise ValueError(f"no traffic named {only}: choose from {[t.name for t in traffics()]}")
    loads = [(t, requests_of(t, tok, seed=i)) for i, t in enumerate(ts)]
    vllm_ok, why = vllm_status()
    chosen = [c for c in columns() if which is None or c["name"] in which]
    t0, busy, measured = time.perf_counter(), other_runnable(), []
    bar = tqdm(total=len(chosen) * len(ts), desc="capstone", unit="run", disable=not progress)
    for col in chosen:
        bar.set_postfix_str(col["name"])
        if col["kind"] == "vllm" and not vllm_ok:
            measured.append({**col, "skipped": why})
            bar.update(len(ts))
            continue
        measured.append(measure_column(col, loads, sizes, folder, kv_per_token, usd_per_hour, bar))
    bar.close()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": {**machine(), "other_runnable_threads_at_start": busy},
              "model": os.path.basename(folder), "usd_per_hour": usd_per_hour, "sizes": asdict(sizes), "scale": scale,
              "traffics": [asdict(t) | {"requests": len(r), "output_tokens": sum(q.output_len
                                                                                                     for q in r),
                                                            "prompt_tokens_mean": sum(q.prompt_len for q in r) / len(r)}
                                               for t, r in loads],
              "columns": measured, "seconds": time.perf_counter() - t0}
    return read(result)


def read(result: dict) -> dict:
    """A run with its bands and decision (re)computed from the measurements, whatever rule it was saved with (the
    bootstrap is seeded: the same file reads the same every time)."""
    traffics = [t | {"at_once": sent_at_once(t)} for t in result["traffics"]]  # one reading for bands and plots
    return {**{k: v for k, v in result.items() if k not in ("noise", "floor")}, "traffics": traffics,
            "bands": bands(result), "decision": decision(result)}


def load(path=None) -> dict:
    """The saved run (package data) or a JSON file written by ``--json``, read with today's rule (``read``)."""
    if path is None:
        from ..data import text
        return read(json.loads(text("capstone_cpu.json")))
    with open(path) as f:
        return read(json.load(f))


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every traffic's request count")
    p.add_argument("--quick", action="store_true", help="scale 0.15, columns all, all - speculative decoding, "
                                                        "transformers serve, all (again) (tests)")
    p.add_argument("--columns", default=None, help="comma-separated column names (default: every one)")
    p.add_argument("--usd-per-hour", type=float, default=0.10, help="the machine's price (default 0.10: a 2-vCPU VM)")
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--plot", metavar="FILE.png", default=None)


def main(args) -> int:
    from ..viz.capstone_plot import format_decision, format_full, plot_capstone
    which = tuple(args.columns.split(",")) if args.columns else None
    scale = args.scale
    if args.quick:
        which, scale = which or ("all", "all - speculative decoding", "transformers serve", AGAIN), 0.15
    known = {c["name"] for c in columns()}
    if which and set(which) - known:
        raise ValueError(f"unknown columns {sorted(set(which) - known)}: choose from {', '.join(sorted(known))}")
    r = run(Sizes(), scale, which, args.usd_per_hour)
    print(format_full(r))
    print()
    print(format_decision(r))
    print(f"{len(r['columns'])} servers x {len(r['traffics'])} traffics in {r['seconds']:.0f} s")
    from ..bench.summary import save_run
    save_run(r, args.json, args.plot, plot_capstone)
    failed = [c["name"] for c in r["columns"] for x in c.get("traffic", {}).values() if x["completed"] < x["requests"]]
    return 1 if failed else 0
