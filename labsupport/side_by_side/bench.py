"""Side by side: ``vllm serve`` and ``python -m labsupport serve`` under the same load, each measured by
two load generators, ours (``benchmark``, chapter 06's ``bench serve``) and vLLM's ``vllm bench serve``.

Two servers times two clients gives four rows. Reading across a row compares the servers; reading
down a server's two rows checks the clients: if ours and vLLM's client disagree about the same
server, the difference is in the measuring, not in the serving. The workload is the same in both
clients' terms: the random dataset (each client draws its own random tokens, with the same
lengths and seed), ``ignore_eos`` so every request yields exactly ``output_len`` tokens, greedy,
streamed text completions, at most ``max_concurrency`` in flight. Servers are measured one after
the other, never together, so neither steals the other's cores; both run with the same knobs
(``parity.start_servers``: the same block size, pool, batch limits and chunked prefill)::

    rows = side_by_side()                      # starts both servers, measures, stops them
    print(format_table(rows, COLUMNS)); plot_side_by_side(rows)
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import procs
from ..bench.serving.serve_bench import COMPLETIONS, benchmark
from ..bench.serving.serve_datasets import load_tokenizer, sample_requests
from ..pd.cluster import stop_all
from ..experiments.parity import ParitySizes, format_table, start_servers
from ..servers import VllmServer, client_env, vllm_bin

COLUMNS = ["server", "load generator", "completed", "failed", "total_output_tokens", "output_throughput",
           "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "request_goodput",
           "duration"]
GENERATORS = ("labsupport bench", "vllm bench serve")


@dataclass
class BenchLoad:
    """The workload and the SLO of the goodput column. The defaults are sized for a short run on 2 CPU cores."""

    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 32
    max_concurrency: int = 8
    request_rate: float = math.inf
    seed: int = 0
    slo: dict = field(default_factory=lambda: {"ttft": 3000.0, "tpot": 250.0})  # ms

    @classmethod
    def gpu(cls) -> "BenchLoad":
        return cls(num_prompts=400, input_len=512, output_len=256, max_concurrency=64,
                   slo={"ttft": 500.0, "tpot": 50.0})


def server_sizes(load: BenchLoad) -> ParitySizes:
    """The servers' knobs for the benchmark: a pool that holds every request in flight (no preemption),
    ``max_num_seqs`` at the client's concurrency, chunked prefill with a 512-token budget."""
    block = ParitySizes().block_size
    per_request = math.ceil((load.input_len + load.output_len) / block) + 1
    return ParitySizes(num_blocks=max(load.max_concurrency * per_request + 1, 2048 // block + 1),
                       max_model_len=max(2048, load.input_len + load.output_len),
                       max_num_seqs=load.max_concurrency, max_num_batched_tokens=512, long_prefill_token_threshold=0)


def run_ours(url: str, load: BenchLoad, tokenizer, model: str = "smol") -> dict:
    """Our load generator, in this process: its summary (vLLM's key names)."""
    requests = sample_requests(tokenizer, "random", load.num_prompts, load.input_len, load.output_len, seed=load.seed)
    result = benchmark(url, model, requests, rate=load.request_rate, max_concurrency=load.max_concurrency,
                       endpoint=COMPLETIONS, seed=load.seed, slo=load.slo, progress=False)
    return result.summary


def run_vllm_bench(url: str, load: BenchLoad, tokenizer_folder, model: str = "smol", timeout_s: float = 600,
                   session=None) -> dict:
    """``vllm bench serve`` from vLLM's venv against ``url``: the JSON it saves (``--save-result``). ``session``:
    a ``session.VllmSession`` to run it in (the same command, without importing vLLM again)."""
    rate = "inf" if math.isinf(load.request_rate) else str(load.request_rate)
    goodput = [f"{k}:{v:g}" for k, v in load.slo.items()]
    with tempfile.TemporaryDirectory(prefix="labsupport-vllm-bench-") as work:
        cmd = [str(vllm_bin("vllm")), "bench", "serve", "--backend", "openai", "--endpoint", COMPLETIONS,
               "--base-url", url, "--model", model, "--tokenizer", str(tokenizer_folder), "--dataset-name", "random",
               "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
               "--num-prompts", str(load.num_prompts), "--max-concurrency", str(load.max_concurrency),
               "--request-rate", rate, "--ignore-eos", "--temperature", "0", "--seed", str(load.seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99,100",
               "--goodput", *goodput, "--disable-tqdm", "--save-result", "--result-dir", work,
               "--result-filename", "result.json"]
        saved = Path(work) / "result.json"
        if session is not None:
            session.vllm(cmd[1:], timeout_s)  # raises with the log's tail if it failed
            if not saved.exists():
                raise RuntimeError(f"vllm bench serve saved no result (log: {session.log_path})")
            return json.loads(saved.read_text())
        proc = procs.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=client_env(), cwd=work)
        if proc.returncode != 0 or not saved.exists():
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(saved.read_text())


def row(server: str, generator: str, summary: dict) -> dict:
    """The table's columns from either generator's summary, and the largest TTFT (ours: ``max_ttft_ms``; vLLM's
    JSON: its 100th percentile) for a run too small for a P99."""
    out = {"server": server, "load generator": generator, **{k: summary.get(k, math.nan) for k in COLUMNS[2:]}}
    out["max_ttft_ms"] = summary.get("max_ttft_ms", summary.get("p100_ttft_ms", math.nan))
    return out


def measure(workers, load: BenchLoad, tokenizer_folder, tokenizer=None, log=print, session=None) -> list[dict]:
    """Each server in turn, each load generator in turn against it: four rows. ``session``: run
    ``vllm bench serve`` in this ``session.VllmSession`` (vLLM imported once for both servers)."""
    tokenizer = tokenizer or load_tokenizer(str(tokenizer_folder))
    rows = []
    for w in workers:
        server = "vLLM" if isinstance(w, VllmServer) else "ours"
        for generator in GENERATORS:
            start = time.time()
            summary = (run_ours(w.url, load, tokenizer) if generator == GENERATORS[0]
                       else run_vllm_bench(w.url, load, tokenizer_folder, session=session))
            rows.append(row(server, generator, summary))
            log(f"  {server} x {generator}: {summary['completed']} requests, "
                f"{summary['output_throughput']:.0f} tok/s ({time.time() - start:.0f} s)")
    return rows


def side_by_side(load: BenchLoad | None = None, servers=None, model=None, log=print) -> list[dict]:
    """The four rows. ``servers``: (ours, vLLM) already running; otherwise both are started here with
    matched knobs (``server_sizes``), started together, measured one after the other, and stopped."""
    from ..models.loader import prepare_default_model
    load = load or BenchLoad()
    folder = model or (servers[0].model if servers else prepare_default_model())
    if servers is not None:
        return measure(servers, load, folder, log=log)
    started = start_servers(server_sizes(load), folder)
    try:
        return measure(started, load, folder, log=log)
    finally:
        stop_all(list(started))


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, numbers rounded; TTFT's tail is the max where a run completed fewer than
    ``MIN_P99_SAMPLES`` requests (a P99 of a handful is its largest sample, or next to it)."""
    from ..percentiles import MIN_P99_SAMPLES
    few = any(r["completed"] < MIN_P99_SAMPLES for r in rows)
    return format_table(rows, [("max_ttft_ms" if few and c == "p99_ttft_ms" else c) for c in COLUMNS])


PANELS = [("output_throughput", "output tokens/s"), ("median_ttft_ms", "median TTFT (ms)"),
          ("median_tpot_ms", "median TPOT (ms)"), ("p99_itl_ms", "P99 ITL (ms)")]


def plot_side_by_side(rows: list[dict], title: str | None = None):
    """One panel per metric; per server, one bar per load generator (two bars that agree: the clients
    measure alike; two servers that differ: the engines do)."""
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.6))
    width = 0.8 / len(GENERATORS)
    for ax, (key, label) in zip(axes, PANELS):
        for g, generator in enumerate(GENERATORS):
            values = [next((r[key] for r in rows if r["server"] == s and r["load generator"] == generator), 0)
                      for s in servers]
            bars = ax.bar([i + (g - (len(GENERATORS) - 1) / 2) * width for i in range(len(servers))], values, width,
                          label=generator)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(servers)), servers)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, title="load generator")
    fig.suptitle(title or "the same workload, two servers, two load generators")
    fig.tight_layout()
    return fig
