"""The parity track: each experiment of chapters 02-05 run again on ``vllm serve``, beside our engine.

Chapters 02-05 built each mechanism by hand: paged KV blocks, a prefix cache with salts, a
continuous batch capped by ``max_num_seqs`` that preempts when blocks run out, chunked prefill.
vLLM has the same mechanisms behind flags of the same names (``KNOBS``). Here both servers get the
same knobs, the same seeded prompts over HTTP, and each side is read from the outside only:
``/metrics`` (``labsupport:`` beside ``vllm:``), and the per-step records (our ``/pd/timeline``;
vLLM's ``--enable-logging-iteration-details`` log lines, since its ``iteration_tokens_total``
histogram counts a chunked prompt when its first token comes out, not step by step)::

    servers = start_servers(ParitySizes())
    try:
        rows = run_parity(servers, ParitySizes())
    finally:
        stop_all(list(servers))
    print(format_table(rows))

Where the two differ (vLLM keeps one block back, needs blocks of 32 tokens on a CPU, ignores the
long-prefill threshold for a lone request) the row's note says so, and ``KNOBS`` lists the flags
with no counterpart. Every size is a ``ParitySizes`` field so a GPU run can use larger ones.
"""
from __future__ import annotations

import asyncio
import math
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..bench.serving.serve_bench import COMPLETIONS, payload, send_request
from ..bench.serving.serve_datasets import SampleRequest, load_tokenizer, sample_requests
from ..pd.cluster import Worker, start_all
from ..serve.metrics import parse_metrics
from ..servers import VllmServer, on_gpu

# our serve flag, vllm serve's, what it sets, the chapter that built it, how the two differ
KNOBS = [dict(zip(("ours", "vllm", "controls", "chapter", "note"), k)) for k in [
    ("--block-size", "--block-size", "tokens per KV block", "02",
     "ours defaults to 16; vLLM's CPU attention needs a multiple of 32 (its CPU default is 128)"),
    ("--num-blocks", "--num-gpu-blocks-override", "KV pool size in blocks", "02",
     "vLLM keeps block 0 back as a null block: N gives N-1 usable, so ours gets N-1"),
    ("--gpu-memory-utilization", "--gpu-memory-utilization / VLLM_CPU_KVCACHE_SPACE", "KV pool size from memory",
     "02", "on a CPU vLLM reads a GiB env variable"),
    ("--max-model-len", "--max-model-len", "longest sequence", "02",
     "vLLM refuses to start unless one sequence of this length fits the pool"),
    ("(on) / --no-enable-prefix-caching", "(on) / --no-enable-prefix-caching", "reuse of cached full blocks", "03",
     "both on by default when serving"),
    ("cache_salt (request field)", "cache_salt (request field)", "who may share cached KV", "03", ""),
    ("--cpu-offload-blocks", "--kv-offloading-size", "a host-memory KV tier", "03",
     "not compared: vLLM's offloading connectors fail without a GPU"),
    ("--max-num-seqs", "--max-num-seqs", "requests in the running batch", "04", ""),
    ("(recompute)", "(recompute)", "preemption when blocks run out", "04",
     "both free the newest request's blocks and requeue it"),
    ("bench --scheduling-policy static", "-", "chapter 04's static-batch baseline", "04",
     "no vLLM equivalent (its --scheduling-policy is fcfs or priority)"),
    ("--max-num-batched-tokens", "--max-num-batched-tokens", "token budget per step", "04-05", ""),
    ("--enable-chunked-prefill", "--enable-chunked-prefill", "split long prompts", "05",
     "off by default in ours, on by default in vLLM"),
    ("--long-prefill-token-threshold", "--long-prefill-token-threshold", "cap on one request's chunk", "05",
     "vLLM applies it only while another request runs or waits"),
]]


@dataclass
class ParitySizes:
    """Every size of the parity run. The defaults are sized for a short run per side on 2 CPU cores."""

    block_size: int = 32
    num_blocks: int = 32  # as vLLM counts it (null block included)
    max_model_len: int = 512
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    long_prefill_token_threshold: int = 48
    prefix_requests: int = 6
    prefix_len: int = 128
    suffix_len: int = 32
    salt_prompt_len: int = 96
    burst_requests: int = 16
    burst_input_len: int = 12
    burst_output_len: int = 8
    tight_requests: int = 8
    tight_input_len: int = 96
    tight_output_len: int = 40
    num_short: int = 4
    short_input_len: int = 12
    short_output_len: int = 24
    long_input_len: int = 384
    seed: int = 0

    @classmethod
    def gpu(cls) -> "ParitySizes":
        """Larger settings for a GPU machine (vLLM's GPU attention takes blocks of 16)."""
        return cls(block_size=16, num_blocks=256, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512,
                   long_prefill_token_threshold=128, prefix_requests=32, prefix_len=512, suffix_len=64,
                   burst_requests=64, tight_requests=32, tight_input_len=256, tight_output_len=128, num_short=16,
                   long_input_len=1536)


def our_args(s: ParitySizes) -> list[str]:
    return ["--served-model-name", "smol", "--block-size", str(s.block_size), "--num-blocks", str(s.num_blocks - 1),
            "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--enable-chunked-prefill",
            "--long-prefill-token-threshold", str(s.long_prefill_token_threshold)]


def vllm_args(s: ParitySizes) -> list[str]:
    return ["--block-size", str(s.block_size), "--num-gpu-blocks-override", str(s.num_blocks),
            "--enable-prefix-caching", "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--enable-chunked-prefill",
            "--long-prefill-token-threshold", str(s.long_prefill_token_threshold),
            "--enable-logging-iteration-details", *(["--gpu-memory-utilization", "0.4"] if on_gpu() else [])]


def start_servers(s: ParitySizes, model=None, cpus: str | None = None,
                  timeout: float = 300.0, wait: bool = True) -> tuple[Worker, VllmServer]:
    """Our server and ``vllm serve`` with matched knobs, started together (their loads overlap), on the
    same cores: experiments then run on one server at a time. ``wait=False``: return as soon as both
    processes run; ``start_all(servers)`` later waits until both answer."""
    from ..models.loader import prepare_default_model
    folder = str(model or prepare_default_model())
    ours = Worker(None, cpus, model=folder, args=our_args(s), name="ours")
    vllm = VllmServer(folder, cpus=cpus, args=vllm_args(s), max_model_len=s.max_model_len)
    start_all([ours, vllm], timeout, wait)
    return ours, vllm


ITERATION = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
                       r"(\d+) generation requests, (\d+) generation tokens")


class Side:
    """One server as the experiments see it: its URL, its ``/metrics`` and its per-step records."""

    def __init__(self, worker: Worker):
        self.worker, self.is_vllm = worker, isinstance(worker, VllmServer)
        self.name, self.prefix = ("vLLM", "vllm:") if self.is_vllm else ("ours", "labsupport:")
        self.url, self.model = worker.url, "smol"

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def counters(self) -> dict[str, float]:
        values = parse_metrics(self.metrics_text())
        return {n: values.get(f"{self.prefix}{n}_total", 0.0)
                for n in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "generation_tokens")}

    def mark(self):
        """Where the step records stand now: a wall time (ours) or the log's length (vLLM)."""
        return os.path.getsize(self.worker.log_path) if self.is_vllm else time.time()

    def steps(self, since) -> list[dict]:
        """Each step after ``since``: prompt tokens fed, requests scheduled, tokens in all."""
        if self.is_vllm:
            time.sleep(0.3)  # the last step's line is written after its output
            with open(self.worker.log_path, errors="replace") as f:
                f.seek(since)
                found = [tuple(map(int, m.groups())) for m in ITERATION.finditer(f.read())]
            return [{"prefill": ct, "requests": cr + gr, "tokens": ct + gt} for cr, ct, gr, gt in found]
        steps = httpx.get(self.url + "/pd/timeline", params={"since": since}, timeout=10).json()["steps"]
        return [{"prefill": sum(s["prefill"].values()), "requests": len(s["prefill"]) + len(s["decode"]),
                 "tokens": sum(s["prefill"].values()) + len(s["decode"])} for s in steps if s["start"] >= since]


def send(side: Side, requests: list[SampleRequest], extra=None, concurrency=None):
    """Stream ``requests`` to the side's ``/v1/completions`` (greedy, ignore_eos), at most ``concurrency`` at a
    time (default all at once); ``extra``: more body fields. Their ``RequestResult``s, in order."""
    async def run():
        limit = asyncio.Semaphore(concurrency or len(requests))
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            async def one(req):
                async with limit:
                    body = {**payload(COMPLETIONS, side.model, req, True, 0.0), **(extra or {})}
                    return await send_request(client, side.url + COMPLETIONS, body, req)
            return await asyncio.gather(*(one(r) for r in requests))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    with ThreadPoolExecutor(1) as pool:  # inside Jupyter's running loop
        return pool.submit(asyncio.run, run()).result()


def kv_capacity(side: Side, s: ParitySizes) -> dict:
    """Blocks, tokens and max concurrency at ``max_model_len``: vLLM's ``cache_config_info`` labels and its
    start-up log line; ours from the free-block gauge at idle (after a request, which sets the gauges)."""
    from prometheus_client.parser import text_string_to_metric_families
    per_request = math.ceil(s.max_model_len / s.block_size)
    if not side.is_vllm:
        free = parse_metrics(side.metrics_text()).get("labsupport:kv_cache_free_blocks", 0.0)
        return {"blocks": int(free), "tokens": int(free) * s.block_size, "concurrency": free / per_request,
                "block_size": s.block_size}
    info = next(smp.labels for fam in text_string_to_metric_families(side.metrics_text())
                for smp in fam.samples if smp.name == "vllm:cache_config_info")
    log = Path(side.worker.log_path).read_text(errors="replace")
    said = re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", log)
    return {"blocks": int(info["num_gpu_blocks"]) - 1, "tokens": int(info["kv_cache_size_tokens"]),
            "concurrency": float(info["kv_cache_max_concurrency"]), "log": said.group(0) if said else "-",
            "block_size": int(info["block_size"])}


def prefix_hits(side: Side, requests, salt: str) -> dict:
    """Shared-prefix prompts one after the other: the share of prompt tokens served from the cache."""
    before = side.counters()
    send(side, requests, extra={"cache_salt": salt}, concurrency=1)
    d = {k: v - before[k] for k, v in side.counters().items()}
    return {"hit_rate": d["prefix_cache_hits"] / max(d["prefix_cache_queries"], 1), **d}


def salted_hits(side: Side, request, salt: str) -> dict:
    """One prompt three times: salt A (fills the cache), salt B (must miss), salt A again (must hit)."""
    hits = {}
    for label, tag in (("first", "a"), ("other_salt", "b"), ("same_salt", "a")):
        before = side.counters()
        send(side, [request], extra={"cache_salt": f"{salt}-{tag}"})
        hits[label] = int(side.counters()["prefix_cache_hits"] - before["prefix_cache_hits"])
    return hits


def batch_and_preemptions(side: Side, requests, salt: str) -> dict:
    """All at once: the largest batch of one step, and the preemptions the pool forced."""
    before, mark = side.counters(), side.mark()
    results = send(side, requests, extra={"cache_salt": salt})
    steps = side.steps(mark)
    return {"peak_running": max((st["requests"] for st in steps), default=0),
            "preemptions": int(side.counters()["num_preemptions"] - before["num_preemptions"]),
            "completed": sum(r.success for r in results)}


def chunked(side: Side, shorts, long_req, lone_req, salt: str) -> dict:
    """Short requests decoding when a long prompt arrives (sent once each short has its first token, so
    the long prefill meets running decodes however slow the machine): its prefill chunks, the largest
    step and the short requests' ITL; then a long prompt alone (vLLM lifts the threshold for it)."""
    extra = {"cache_salt": salt}
    before, first = side.counters(), side.mark()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(send, side, shorts, extra=extra)
        while side.counters()["generation_tokens"] - before["generation_tokens"] < len(shorts) and not running.done():
            time.sleep(0.05)
        mark = side.mark()
        long_result = send(side, [long_req], extra=extra)[0]
        results = running.result()
    steps, after = side.steps(first), side.steps(mark)
    gaps = sorted(g * 1000 for r in results for g in r.itl)
    mark = side.mark()
    send(side, [lone_req], extra=extra)
    lone = [st["prefill"] for st in side.steps(mark) if st["prefill"]]
    return {"max_chunk": max((st["prefill"] for st in after), default=0),
            "chunk_steps": sum(st["prefill"] > 0 for st in after), "max_step": max(st["tokens"] for st in steps),
            "short_max_itl_ms": gaps[-1], "short_median_itl_ms": gaps[len(gaps) // 2],
            "long_ttft_ms": long_result.ttft * 1000, "lone_steps": len(lone), "lone_max_chunk": max(lone, default=0)}


def workloads(s: ParitySizes, tokenizer) -> dict:
    """The seeded prompts, each workload from its own seed: no two share a prefix unless meant to."""
    def make(name, n, i, o, seed, **kw):
        return sample_requests(tokenizer, name, n, i, o, seed=s.seed + seed, **kw)
    return {"prefix": make("shared-prefix", s.prefix_requests, s.suffix_len, 2, 1, prefix_len=s.prefix_len),
            "salt": make("random", 1, s.salt_prompt_len, 1, 2)[0],
            "burst": make("random", s.burst_requests, s.burst_input_len, s.burst_output_len, 3),
            "tight": make("random", s.tight_requests, s.tight_input_len, s.tight_output_len, 4),
            "shorts": make("random", s.num_short, s.short_input_len, s.short_output_len, 5),
            "long": make("random", 1, s.long_input_len, 4, 6)[0], "lone": make("random", 1, s.long_input_len, 4, 7)[0]}


def measure(side: Side, s: ParitySizes, w: dict, salt: str) -> dict:
    """Every experiment on one side, one after the other (a warm-up request first), flattened."""
    send(side, [SampleRequest("Hello", 1, 2)])
    parts = {"kv": kv_capacity(side, s), "prefix": prefix_hits(side, w["prefix"], salt),
             "salt": salted_hits(side, w["salt"], salt), "burst": batch_and_preemptions(side, w["burst"], salt),
             "tight": batch_and_preemptions(side, w["tight"], salt),
             "chunked": chunked(side, w["shorts"], w["long"], w["lone"], salt)}
    return {f"{part}.{k}": v for part, values in parts.items() for k, v in values.items()}


def run_parity(servers, s: ParitySizes | None = None, tokenizer=None, salt: str | None = None) -> list[dict]:
    """Both sides measured on the same workloads, servers one after the other: the rows of one table.
    ``salt`` (default: fresh) keeps a re-run on the same servers from hitting the last run's cache."""
    s = s or ParitySizes()
    tokenizer = tokenizer or load_tokenizer(servers[0].model)
    w = workloads(s, tokenizer)
    salt = salt or uuid.uuid4().hex[:8]
    ours, vllm = (measure(Side(x), s, w, salt) for x in servers)
    return [{"chapter": ch, "experiment": what.format(s=s), "knob": knob.format(s=s), "ours": ours.get(key, "-"),
             "vLLM": vllm.get(key, "-"), "note": note.format(s=s, log=vllm.get("kv.log", "-")), "key": key}
            for key, ch, what, knob, note in ROWS]


ROWS = [  # measured value, chapter, experiment, knob, note (formatted with the sizes)
    ("kv.block_size", "02", "block size (tokens)", "--block-size",
     "vLLM's CPU attention needs a multiple of 32; ours defaults to 16"),
    ("kv.blocks", "02", "usable KV blocks", "--num-blocks / --num-gpu-blocks-override",
     "override {s.num_blocks}: vLLM keeps one as its null block, so ours is given one fewer"),
    ("kv.tokens", "02", "KV capacity (tokens)", "blocks x block size",
     "vLLM's cache_config_info counts its null block too"),
    ("kv.concurrency", "02", "max concurrency at {s.max_model_len} tokens / request", "--max-model-len",
     "vLLM's log: {log} (null block included)"),
    ("prefix.hit_rate", "03", "prefix hit rate, {s.prefix_requests} prompts sharing {s.prefix_len} tokens",
     "prefix caching (on)", "whole blocks only; the last prompt token is always computed"),
    ("salt.other_salt", "03", "hit tokens: same prompt, another cache_salt", "cache_salt", "must be 0"),
    ("salt.same_salt", "03", "hit tokens: same prompt, same cache_salt", "cache_salt", ""),
    ("burst.peak_running", "04", "largest batch, {s.burst_requests} requests sent at once",
     "--max-num-seqs {s.max_num_seqs}", "requests in one step"),
    ("tight.preemptions", "04", "preemptions, {s.tight_requests} x ({s.tight_input_len}+{s.tight_output_len}) "
     "tokens, a pool of {s.num_blocks} blocks", "--num-blocks (a tight pool)", "recompute preemption on both"),
    ("chunked.max_chunk", "05", "largest prefill chunk of a long prompt among decodes",
     "--long-prefill-token-threshold {s.long_prefill_token_threshold}", "{s.long_input_len}-token prompt"),
    ("chunked.chunk_steps", "05", "steps to prefill it", "--enable-chunked-prefill", ""),
    ("chunked.max_step", "05", "largest step (tokens)", "--max-num-batched-tokens {s.max_num_batched_tokens}", ""),
    ("chunked.short_max_itl_ms", "05", "short requests' max ITL (ms)", "chunked prefill", "the stall a chunk costs"),
    ("chunked.short_median_itl_ms", "05", "short requests' median ITL (ms)", "chunked prefill", ""),
    ("chunked.long_ttft_ms", "05", "long prompt's TTFT (ms)", "chunked prefill", ""),
    ("chunked.lone_steps", "05", "steps to prefill a lone long prompt", "--long-prefill-token-threshold",
     "vLLM drops the threshold when no other request runs or waits"),
]


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A markdown table of dict rows (no pandas needed): it prints as plain text and renders in Jupyter."""
    columns = columns or [c for c in rows[0] if c != "key"]

    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1000 else f"{v:.0f}" if isinstance(v, float) else str(v)
    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [[c.ljust(w) for c, w in zip(row, widths)] for row in [columns, *cells]]
    rule = ["-" * w for w in widths]
    return "\n".join("| " + " | ".join(row) + " |" for row in [lines[0], rule, *lines[1:]])
