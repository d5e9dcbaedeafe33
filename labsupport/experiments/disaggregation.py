"""Chapter 07's measurements: colocated vs chunked prefill vs 1P+1D, with chapter 06's load generator.

Every number comes from real processes (``pd/cluster.py``) driven over HTTP by ``bench serve``'s
client, so each experiment is also a command line::

    python -m labsupport serve --port 8001 --role prefill --cpu-affinity 0 &
    python -m labsupport serve --port 8002 --role decode --cpu-affinity 1 &
    python -m labsupport router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000 &
    python -m labsupport bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --dataset-name long-short --num-prompts 24 --random-input-len 64 --long-input-len 1024 --request-rate 2

What is measured, and why:

* **Interference** (``interference``): short requests decoding while long prompts arrive. The
  short ones' P99 ITL and TPOT show how much a long prefill stalls everyone's next token.
* **SLO attainment against rate** (``attainment_sweep``): DistServe's goodput method, the share
  of requests inside both the TTFT and the TPOT SLO at each rate; the best rate with >= 90 %.
* **Where the split stops paying** (``slo_grid``): the same attainment over load x long-prompt
  length, colocated against 1P+1D cell by cell (at GPU scale: ``sim.pd_cluster.slo_grid``, ``crossover``).
* **Transfer cost** (``transfer_costs``): pull time against KV bytes, the achieved GB/s beside
  the raw loopback TCP bandwidth (``loopback_bandwidth``) of the same machine.
* **1P+1D's TTFT in parts** (``ttft_parts``): each request's wait, one-core prefill, hand-off, pull
  and first decode step, read off the workers' ``/pd/timeline`` beside the client's own clock.

Every comparison gives both sides one budget (``split_budget``): the colocated server's KV blocks
and ``max_num_seqs`` are the sum of the two PD workers', or the split would win on memory alone.
"""
from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx

from ..bench.serving.serve_bench import COMPLETIONS, BenchResult, benchmark
from ..percentiles import percentile, tail_of
from ..pd.cluster import Router, Worker, start_all, stop_all

WORKER_ARGS = ["--num-blocks", "512", "--max-num-batched-tokens", "2048",  # ~0.4 GB of KV: give pool_args instead
               "--no-enable-chunked-prefill",  # serve chunks by default: the colocated baseline does not
               "--engine-in-process"]  # one process per worker: a core process each would add another torch process
CHUNKED_ARGS = ["--enable-chunked-prefill", "--max-num-batched-tokens", "256"]
BLOCK_SIZE = 16


def pool_args(token_counts, slack: float = 1.25, block_size: int = BLOCK_SIZE) -> list[str]:
    """``serve`` flags for a KV pool that holds the given requests (prompt + answer tokens each) all at once,
    with ``slack`` to spare, instead of a default: on the CPU each block of the default model is 0.7 MB, and
    four workers of 512 blocks held 1.5 GB of KV for a chapter that had a small part of them in flight. A
    request that does not fit waits for blocks; it does not fail."""
    return ["--num-blocks", str(pool_blocks(token_counts, slack, block_size))]


def pool_blocks(token_counts, slack: float = 1.25, block_size: int = BLOCK_SIZE) -> int:
    """The number of KV blocks ``pool_args`` asks for (at least 16)."""
    blocks = sum(-(-n // block_size) for n in token_counts)
    return max(16, int(blocks * slack))


def share_budget(num_blocks: int, max_num_seqs: int, parts: int) -> list[list[str]]:
    """``serve`` flags for one KV and slot budget cut into ``parts`` shares, as even as integers allow, the
    larger shares last (the decode workers', who keep a request's KV for its whole answer)."""
    if parts < 1 or num_blocks < parts or max_num_seqs < parts:
        raise ValueError(f"{num_blocks} blocks and {max_num_seqs} sequences do not split into {parts} shares")

    def cut(total):
        base, extra = divmod(total, parts)
        return [base + (k >= parts - extra) for k in range(parts)]
    return [["--num-blocks", str(b), "--max-num-seqs", str(q)] for b, q in zip(cut(num_blocks), cut(max_num_seqs))]


def split_budget(num_blocks: int, max_num_seqs: int) -> tuple[list[str], list[str], list[str]]:
    """``serve`` flags for one budget spent two ways: ``(colocated, prefill, decode)``.

    The colocated server gets all ``num_blocks`` and ``max_num_seqs``; the PD workers split them, the
    odd one to the decode worker (it keeps a request's KV for the whole answer, the prefill worker only
    until the pull). Giving each PD worker the colocated budget would double the split's memory and
    slots, and any win could be that. Each half must still hold the longest prompt: the caller sizes it."""
    if num_blocks < 2 or max_num_seqs < 2:
        raise ValueError(f"a budget to split needs at least 2 blocks and 2 sequences, got {num_blocks}, {max_num_seqs}")
    prefill, decode = share_budget(num_blocks, max_num_seqs, 2)
    return ["--num-blocks", str(num_blocks), "--max-num-seqs", str(max_num_seqs)], prefill, decode


@dataclass
class Deployment:
    """One way to serve: the processes, the URL clients use, and the engines behind it (for timelines)."""

    name: str
    processes: list[Worker]
    entry: Worker  # the router, or the one colocated worker
    engines: dict[str, str] = field(default_factory=dict)  # lane name -> worker URL

    @property
    def url(self) -> str:
        return self.entry.url


def colocated(name: str = "colocated", cpus: str = "0-1", chunked: bool = False, args=(), model=None) -> Deployment:
    """One server doing both phases on ``cpus``; ``chunked``: long prompts are fed 256 tokens per step."""
    w = Worker(None, cpus, model=model, args=[*WORKER_ARGS, *(CHUNKED_ARGS if chunked else ()), *args], name=name)
    return Deployment(name, [w], w, {name: w.url})


def disaggregated(name: str = "1P+1D", prefill_cpus: str = "0", decode_cpus: str = "1", args=(),
                  model=None, prefill_args=(), decode_args=()) -> Deployment:
    """A prefill worker and a decode worker, each pinned to its own cores, behind a PD router. ``args``
    go to both; ``prefill_args``/``decode_args`` to one (their share of a budget: ``split_budget``)."""
    p = Worker("prefill", prefill_cpus, model=model, args=[*WORKER_ARGS, *args, *prefill_args], name="prefill")
    d = Worker("decode", decode_cpus, model=model, args=[*WORKER_ARGS, *args, *decode_args], name="decode")
    r = Router(prefill=[p], decode=[d])
    return Deployment(name, [p, d, r], r, {"prefill": p.url, "decode": d.url})


def xpyd(prefill_cpus: list[str], decode_cpus: list[str], num_blocks: int, max_num_seqs: int, args=(),
         model=None, name: str | None = None) -> Deployment:
    """x prefill and y decode workers (one per entry of ``prefill_cpus``/``decode_cpus``, pinned there) behind
    one PD router, sharing one budget (``share_budget``): the prefill round robin, the decode least loaded.
    Named "xPyD" (2P1D: two prefill workers, one decode) unless ``name`` says otherwise."""
    shares = share_budget(num_blocks, max_num_seqs, len(prefill_cpus) + len(decode_cpus))
    pre = [Worker("prefill", c, model=model, args=[*WORKER_ARGS, *args, *shares[k]], name=f"prefill {k + 1}")
           for k, c in enumerate(prefill_cpus)]
    dec = [Worker("decode", c, model=model, args=[*WORKER_ARGS, *args, *shares[len(pre) + k]], name=f"decode {k + 1}")
           for k, c in enumerate(decode_cpus)]
    return _behind_router(name or f"{len(pre)}P{len(dec)}D", pre, dec)


def _behind_router(name: str, pre: list[Worker], dec: list[Worker]) -> Deployment:
    """Prefill and decode workers behind one PD router: the deployment, its lanes named after the workers."""
    r = Router(prefill=pre, decode=dec)
    return Deployment(name, [*pre, *dec, r], r, {w.name: w.url for w in pre + dec})


def two_layouts(first: str, second: str, num_blocks: int, max_num_seqs: int, args=(),
                model=None) -> list[Deployment]:
    """2P1D and 1P2D on two cores from four workers started once, each layout on one budget.

    Three workers on two cores: the doubled role gets one worker on each core, the single role shares a
    core. Both layouts hold a prefill worker on ``first`` and a decode worker on ``second``; 2P1D adds a
    prefill worker on ``second``, 1P2D a decode worker on ``first``. So four workers serve both, each
    behind its layout's router, and the one a layout leaves out sits idle while the other runs (an idle
    worker's CPU time is negligible: ``benchmarks/README.md``). The budget is cut in three
    (``share_budget``): the shared prefill worker has the first share, the shared decode worker the largest,
    and each layout's third worker the middle one, so either layout's three shares add up to the whole budget."""
    s = share_budget(num_blocks, max_num_seqs, 3)

    def worker(role, cpus, share, name):
        return Worker(role, cpus, model=model, args=[*WORKER_ARGS, *args, *share], name=name)
    p1, d1 = worker("prefill", first, s[0], "prefill 1"), worker("decode", second, s[2], "decode 1")
    p2, d2 = worker("prefill", second, s[1], "prefill 2"), worker("decode", first, s[1], "decode 2")
    return [_behind_router("2P1D", [p1, p2], [d1]), _behind_router("1P2D", [p1], [d1, d2])]


def _each_once(processes):
    """``processes`` without repeats (deployments may share workers), in order."""
    seen, out = set(), []
    for p in processes:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def start(deployments: list[Deployment], timeout: float = 240.0) -> list[Deployment]:
    """Start every process of every deployment at once (model loads overlap), routers with their workers: a
    router probes its workers every second and answers ``/health`` once they do, so waiting for the workers
    first only added a router's start-up to every deployment's. A worker two deployments share
    starts once."""
    workers = _each_once(p for d in deployments for p in d.processes if not isinstance(p, Router))
    routers = _each_once(p for d in deployments for p in d.processes if isinstance(p, Router))
    try:
        start_all(workers + routers, timeout, wait=False)
        start_all(workers, timeout)
        start_all(routers, 60)
    except BaseException:
        stop_all(routers + workers)
        raise
    return deployments


def stop(deployments: list[Deployment]):
    stop_all(_each_once(p for d in deployments for p in reversed(d.processes)))


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def run(dep: Deployment, requests, rate: float, seed: int = 0, slo: dict | None = None,
        max_concurrency: int | None = None) -> BenchResult:
    """One load run through the deployment's front door (completions, greedy, ignore_eos, streamed).
    ``max_concurrency=1`` with ``rate=math.inf``: each request alone, the next sent when one ends."""
    return benchmark(dep.url, model_name(dep.url), requests, rate=rate, endpoint=COMPLETIONS, seed=seed, slo=slo,
                     max_concurrency=max_concurrency, progress=False)


def split(result: BenchResult, long_from: int) -> dict:
    """The run seen by the two kinds of request: short ones (their decode is what prefills stall) and long.
    The short requests' tails follow the course's rule (``percentiles.tail_of``: a P99 over 100 samples or
    more, else the max); ``short_itl_tail`` / ``short_tpot_tail`` say which."""
    ok = [r for r in result.requests if r.success]
    short, long_ = [r for r in ok if r.prompt_len < long_from], [r for r in ok if r.prompt_len >= long_from]

    def ms(values, q):
        return percentile([v * 1000 for v in values], q) if values else math.nan
    itls, tpots = [g for r in short for g in r.itl], [r.tpot for r in short if r.output_tokens > 1]
    (itl_tail, itl_ms), (tpot_tail, tpot_ms) = (tail_of([v * 1000 for v in x]) for x in (itls, tpots))
    return {"short_itl_tail": itl_tail, "short_tail_itl_ms": itl_ms, "short_p50_itl_ms": ms(itls, 50),
            "short_tpot_tail": tpot_tail, "short_tail_tpot_ms": tpot_ms,
            "short_p50_ttft_ms": ms([r.ttft for r in short], 50),
            "long_p50_ttft_ms": ms([r.ttft for r in long_], 50),
            "output_throughput": result.summary["output_throughput"], "failed": result.summary["failed"]}


def interference(deployments: list[Deployment], requests, rate: float, long_from: int, seed: int = 0) -> dict:
    """The same long-short workload through each deployment, one after the other: name -> ``split``."""
    return {d.name: split(run(d, requests, rate, seed), long_from) for d in deployments}


def attainment(result: BenchResult, slo: dict, max_prompt_len: int | None = None) -> float:
    """Share of requests that succeeded inside every SLO (``{"ttft": ms, "tpot": ms}``). ``max_prompt_len``:
    judge only the requests with shorter prompts (the interactive ones; a long document's prefill alone
    can take longer than a chat user's TTFT SLO, and is judged by its own)."""
    measured = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot}
    judged = [r for r in result.requests if max_prompt_len is None or r.prompt_len < max_prompt_len]
    good = [r for r in judged if r.success and all(measured[k](r) * 1000 <= v for k, v in slo.items())]
    return len(good) / max(len(judged), 1)


def attainment_sweep(deployments: list[Deployment], loads: list, rates: list[float], slo: dict,
                     target: float = 0.9, seed: int = 0, max_prompt_len: int | None = None) -> dict:
    """DistServe's method: SLO attainment at each rate; the goodput is the highest rate at >= ``target``.

    ``loads``: one request list per rate, each different: the servers cache prefixes, so the same
    prompts sent again would find their KV cached and flatter every rate after the first."""
    if len(loads) != len(rates):
        raise ValueError(f"{len(rates)} rates need {len(rates)} request lists, got {len(loads)}")
    table = {}
    for d in deployments:
        rows = [(rate, attainment(run(d, load, rate, seed), slo, max_prompt_len)) for rate, load in zip(rates, loads)]
        ok = [rate for rate, a in rows if a >= target]
        table[d.name] = {"rates": [r for r, _ in rows], "attainment": [a for _, a in rows],
                         "goodput_rate": max(ok) if ok else 0.0}
    return table


def slo_cell(result: BenchResult, slo: dict, max_prompt_len: int | None = None) -> dict:
    """One run judged by the SLO: attainment (as ``attainment``), how many requests that is out of how many
    judged, and goodput in requests per second (those inside both SLOs over the run's duration)."""
    judged = [r for r in result.requests if max_prompt_len is None or r.prompt_len < max_prompt_len]
    a = attainment(result, slo, max_prompt_len)
    good = round(a * len(judged))
    duration = result.summary["duration"]
    return {"attainment": a, "good": good, "judged": len(judged), "goodput": good / duration if duration > 0 else 0.0}


def slo_grid(deployments: list[Deployment], loads: dict, slo: dict, seed: int = 0,
             max_prompt_len: int | None = None, measured: dict | None = None) -> dict:
    """``loads``: ``{(long_prompt_len, rate): requests}``, a fresh list per cell (prefix caches would flatter
    repeats). Runs every cell through every deployment: ``{(long_prompt_len, rate): {name: slo_cell}}``.

    ``measured``: ``{cell: {name: BenchResult}}`` for cells already run with exactly that cell's requests
    and rate (a chapter's earlier section): judged here, not run again. A run is judged after the fact
    from its per-request timings, so the SLO need not be known when it ran."""
    measured = measured or {}

    def result(d, cell, requests):
        if d.name in measured.get(cell, {}):
            return measured[cell][d.name]
        return run(d, requests, cell[1], seed)
    return {cell: {d.name: slo_cell(result(d, cell, requests), slo, max_prompt_len) for d in deployments}
            for cell, requests in loads.items()}


def prefill_stalls(timelines: dict, long_from: int) -> dict:
    """What the decoders rode through in one deployment's run (its engines' ``/pd/timeline`` answers): the steps
    that carried decode rows *and* tokens of a long prompt (a request that prefilled ``long_from`` tokens or more
    in all). Returns ``stalled_steps``, ``decode_rows`` (decode rows in them: each is one slowed gap of some
    request), ``max_prompt_tokens`` (the most long-prompt tokens in one such step) and ``longest_ms``."""
    fed: dict[str, int] = {}
    steps = [s for t in timelines.values() if "steps" in t for s in t["steps"]]
    for s in steps:
        for rid, n in s["prefill"].items():
            fed[rid] = fed.get(rid, 0) + n
    long_ids = {rid for rid, n in fed.items() if n >= long_from}
    stalled = [s for s in steps if s["decode"] and long_ids & set(s["prefill"])]
    return {"stalled_steps": len(stalled), "decode_rows": sum(len(s["decode"]) for s in stalled),
            "max_prompt_tokens": max((sum(n for r, n in s["prefill"].items() if r in long_ids) for s in stalled),
                                     default=0),
            "longest_ms": max(((s["end"] - s["start"]) * 1000 for s in stalled), default=0.0)}


def busy_during(steps: list[dict], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` during which a worker was computing a step (its timeline's ``steps``)."""
    return sum(max(0.0, min(end, s["end"]) - max(start, s["start"])) for s in steps)


def ttft_parts(result: BenchResult, timelines: dict, prefill: str = "prefill", decode: str = "decode",
               clock_offset: float | None = None) -> list[dict]:
    """1P+1D's TTFT in the parts the workers recorded, one dict per successful request (ms):

    * ``queue``: sent until the prefill worker's step with its prompt began (the router's first leg and
      the wait behind other prompts on the prefill worker's one core);
    * ``prefill``: that step (or those steps), the prompt's forward pass on one core;
    * ``hand_off``: prefill done until the decode worker starts the pull (the answer back to the router,
      the router's second leg, and the decode worker's scheduler taking it up at its next step);
    * ``transfer``: the pull itself, with ``decode_busy``/``prefill_busy``: the share of it during which each
      worker's engine was computing a step on the core the pull's threads share (``pull_ok`` False: the pull
      failed, a lease ran out, and the decode worker recomputed the prompt within ``first_token``);
    * ``first_token``: pull done until the client read the first token (the decode worker's current step
      ends, then a step recomputes the prompt's last token, and the token streams back).

    The parts add up to the client's TTFT. ``timelines``: ``fetch_timelines`` of the two workers after the
    run (nothing else sent to them meanwhile); the client's ``perf_counter`` times become wall-clock ones by
    ``clock_offset`` (default: this process's ``time.time() - time.perf_counter()``). The client's requests
    are matched to the prefill worker's by order of arrival, ties by prompt length."""
    offset = time.time() - time.perf_counter() if clock_offset is None else clock_offset
    pre_steps, dec_steps = timelines[prefill].get("steps") or [], timelines[decode].get("steps") or []
    engine_id = timelines[prefill].get("engine_id")
    spans: dict[str, list] = {}  # transfer id -> [first step start, last step end, prompt tokens]
    for s in pre_steps:
        for rid, n in s["prefill"].items():  # the connector names a transfer "<engine id>-<request id>"
            span = spans.setdefault(f"{engine_id}-{rid}", [s["start"], s["end"], 0])
            span[0], span[1], span[2] = min(span[0], s["start"]), max(span[1], s["end"]), span[2] + n
    pulls = {t["transfer_id"]: t for t in timelines[decode].get("transfers") or [] if t["role"] == "recv"}
    waiting = sorted((spans[tid][0], tid) for tid in pulls if tid in spans)
    done = sorted((r for r in result.requests if r.success), key=lambda r: r.start_time)
    if len(waiting) != len(done):
        raise ValueError(f"{len(done)} requests succeeded but the timelines hold {len(waiting)} pulls: "
                         "fetch them right after the run, with nothing else sent to these workers")
    rows = []
    for r in done:
        near = waiting[:3]  # the next few to arrive: the one whose prompt length is closest
        _, tid = min(near, key=lambda w: (abs(spans[w[1]][2] - r.prompt_len), w[0]))
        waiting.remove(next(w for w in near if w[1] == tid))
        sent, first = r.start_time + offset, r.start_time + offset + r.ttft
        p0, p1, _ = spans[tid]
        pull = pulls[tid]
        took = max(pull["end"] - pull["start"], 1e-9)
        rows.append({"prompt_tokens": r.prompt_len, "ttft": 1e3 * r.ttft, "queue": 1e3 * (p0 - sent),
                     "prefill": 1e3 * (p1 - p0), "hand_off": 1e3 * (pull["start"] - p1),
                     "transfer": 1e3 * took, "first_token": 1e3 * (first - pull["end"]), "bytes": pull["num_bytes"],
                     "pull_ok": pull["ok"],
                     "decode_busy": busy_during(dec_steps, pull["start"], pull["end"]) / took,
                     "prefill_busy": busy_during(pre_steps, pull["start"], pull["end"]) / took})
    return rows


def transfer_costs(prefill_url: str, decode_url: str, tokenizer, lengths: list[int], seed: int = 0) -> list[dict]:
    """For prompts of each length: hand one off by hand (the router's two legs) and read the decode worker's
    own record of the pull (``/pd/timeline``): bytes, milliseconds, GB/s."""
    from ..bench.serving.serve_datasets import sample_requests
    rows = []
    for n in lengths:
        req = sample_requests(tokenizer, "random", 1, n, 1, seed=seed + n)[0]
        body = {"prompt": req.prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        since = time.time()
        pre = httpx.post(prefill_url + "/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}},
                         timeout=120).json()
        httpx.post(decode_url + "/v1/completions", json={**body, "kv_transfer_params": pre["kv_transfer_params"]},
                   timeout=120).raise_for_status()
        recv = [t for t in httpx.get(decode_url + "/pd/timeline", params={"since": since}, timeout=10).json()["transfers"]
                if t["role"] == "recv" and t["transfer_id"] == pre["kv_transfer_params"]["remote_request_id"]]
        t = recv[-1]
        seconds = t["end"] - t["start"]
        rows.append({"prompt_tokens": req.prompt_len, "kv_bytes": t["num_bytes"], "ms": seconds * 1000,
                     "gbps": t["num_bytes"] / seconds / 1e9})
    return rows


def loopback_bandwidth(num_bytes: int = 256 << 20, chunk: int = 4 << 20, repeats: int = 3) -> float:
    """Raw TCP over loopback, one connection, GB/s: the ceiling our KV pulls run under on this machine.

    The best of ``repeats`` runs: a ceiling, and one run on a shared 2-core machine can read well below it."""
    return max(_loopback_once(num_bytes, chunk) for _ in range(repeats))


def _loopback_once(num_bytes: int, chunk: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def sink():
        conn, _ = server.accept()
        with conn:
            buf, got = bytearray(chunk), 0
            while got < num_bytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            conn.sendall(b"k")

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    data = memoryview(bytearray(chunk))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.perf_counter()
        for _ in range(num_bytes // chunk):
            sock.sendall(data)
        sock.recv(1)
        elapsed = time.perf_counter() - start
    t.join(5)
    server.close()
    return num_bytes / elapsed / 1e9
