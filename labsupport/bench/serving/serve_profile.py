"""``bench serve-profile``: where the served path spends its time at 64 streams, sampled with py-spy.

A server is started (``ours-thread``: the engine-loop thread in the API process, ``--engine-in-process``;
``ours``: the engine core in its own process), ``vllm bench serve`` sends it 64 chat requests at once
(256 tokens in, 64 out), and py-spy samples every thread of the server's processes while the load runs,
twice: once counting every sample (where each thread is), once only the thread that holds the GIL
(who the others wait for). Each sample's stack is put in one bucket by the frames it contains: the
model's forward pass, scheduling and KV bookkeeping, sampling, detokenizing, the event loop's request
parsing, tokenizing, SSE and JSON work, HTTP protocol, idle. The table is the share of samples per
bucket, per thread.

    python -m labsupport bench serve-profile --json benchmarks/serve-profile-cpu-DATE.json
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from .serve_compare import REPO, VllmBenchLoad, run_vllm_bench, start_server
from ..summary import write_report

LOAD = VllmBenchLoad("burst", 64, 256, 64)
# (bucket, substrings of a frame that put a sample in it), checked in this order: the innermost cause first
BUCKETS = [
    ("idle", ("epoll", "select (selectors", "_worker (concurrent", "wait (threading", "poll (zmq", "Event.wait",
              "sleep", "_run_once (asyncio/base_events.py", "watch (labsupport/procs.py")),
    ("tokenize", ("tokenization_utils", "tokenize (labsupport/frontend", "chat_tokens", "apply_chat_template")),
    ("detokenize", ("detokenizer.py", "TokenText", "convert_ids_to_tokens", "decode (transformers")),
    ("sample", ("sampler.py",)),
    ("model forward", ("models/llama.py", "runner.py", "cpu_decode_layers", "paged_attention",
                       "labsupport/kernels/", "products.py")),
    ("schedule and KV bookkeeping", ("scheduler.py", "lifecycle.py", "kv_cache_manager.py", "block_pool.py",
                                     "prefix_cache.py")),
    ("engine-core messages", ("engine_core.py", "core_client.py", "messages.py", "msgspec", "zmq")),
    ("SSE and JSON", ("completions.py", "sse_starlette", "json/encoder", "openai_format.py", "request_stream.py")),
    ("request parsing", ("fastapi", "pydantic", "starlette/routing", "guard.py", "protocol.py")),
    ("HTTP protocol", ("uvicorn", "h11", "asyncio/selector_events")),
]


def bucket(stack: str) -> str:
    for name, needles in BUCKETS:
        if any(n in stack for n in needles):
            return name
    return "other Python"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(REPO / ".venv-clients" / "bin" / "py-spy")
    if not Path(found).exists():
        raise ValueError("py-spy is not installed: `make clients` (or pip install py-spy)")
    return found


def sample(pid: int, seconds: float, gil: bool) -> dict[str, Counter]:
    """thread name -> bucket -> samples, from py-spy's raw output for ``pid`` (its child processes too)."""
    out = Path(f"/tmp/labsupport-py-spy-{pid}-{int(gil)}.txt")
    cmd = [py_spy(), "record", "--format", "raw", "-r", "100", "-d", str(int(seconds)), "-p", str(pid),
           "--threads", "--subprocesses", "-o", str(out), "--nonblocking"]
    cmd += ["--gil"] if gil else ["--idle"]
    subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    threads: dict[str, Counter] = defaultdict(Counter)
    for line in out.read_text().splitlines() if out.exists() else []:
        # 'process PID:"cmd";[process PID:"cmd";]thread (TID): NAME;frame;frame COUNT' (--subprocesses)
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        processes = [p for p in parts if p.startswith("process ")]
        thread = next((i for i, p in enumerate(parts) if p.startswith("thread (")), len(parts) - 1)
        name = parts[thread].partition(": ")[2]
        if processes and "resource_tracker" in processes[-1]:
            continue  # multiprocessing's helper process: it only waits
        process = "core" if processes and "spawn_main" in processes[-1] else "api"
        threads[f"{process}:{name}"][bucket(";".join(parts[thread + 1:]))] += int(count)
    out.unlink(missing_ok=True)
    return threads


def wait_for_load(url: str, done: threading.Event, timeout: float = 180.0):
    """Return once the server runs requests (its ``/metrics`` gauge), or the load ended, or ``timeout``."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done.is_set():
        try:
            for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
                if line.startswith("labsupport:num_requests_running") and float(line.rsplit(" ", 1)[1]) > 0:
                    return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)


def profile(engine: str, folder: str, seconds: float = 20.0, log=print) -> dict:
    server = start_server(engine, folder)
    try:
        run_vllm_bench(server.url, VllmBenchLoad("warm-up", 8, 64, 8), folder)
        result = {}
        done = threading.Event()

        def load():
            try:
                result["bench"] = run_vllm_bench(server.url, LOAD, folder)
            finally:
                done.set()
        threading.Thread(target=load, daemon=True).start()
        wait_for_load(server.url, done)  # `vllm bench serve` itself takes seconds to start: sample the load, not that
        everything = sample(server.proc.pid, seconds, gil=False)
        holders = sample(server.proc.pid, min(seconds, 10), gil=True) if not done.is_set() else {}
        done.wait(900)
        log(f"{engine}: {result.get('bench', {}).get('output_throughput', float('nan')):.1f} output tok/s under the profiler")
        return {"samples": {t: dict(c) for t, c in everything.items()},
                "gil_holders": {t: dict(c) for t, c in holders.items()}, "bench": result.get("bench")}
    finally:
        from ...pd.cluster import stop_all
        stop_all([server])


def shares(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """Each thread's samples as % of that thread's own: where it spends its time."""
    return {t: {b: 100 * n / (sum(c.values()) or 1) for b, n in c.items()} for t, c in counts.items()}


def format_profile(report: dict) -> str:
    lines = []
    for engine, data in report["results"].items():
        lines.append(f"### {engine} (% of each thread's samples; in brackets, % of the samples where it held the GIL)")
        everything, holders = shares(data["samples"]), shares(data["gil_holders"])
        names = [b for b, _ in BUCKETS] + ["other Python"]
        threads = sorted(everything, key=lambda t: -sum(everything[t].values()))[:4]
        lines.append("| bucket | " + " | ".join(threads) + " |")
        lines.append("|---" * (len(threads) + 1) + "|")
        for b in names:
            cells = [f"{everything[t].get(b, 0):.0f} % ({holders.get(t, {}).get(b, 0):.0f} %)" for t in threads]
            if any(everything[t].get(b, 0) >= 0.5 or holders.get(t, {}).get(b, 0) >= 0.5 for t in threads):
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--engines", default="ours-thread,ours")
    p.add_argument("--seconds", type=float, default=20.0, help="sampling time under the load")
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--model", default=None)


def main(args) -> int:
    from ...models.loader import prepare_default_model
    from ...machine import machine
    folder = str(args.model or prepare_default_model())
    if os.geteuid() != 0:
        print("note: py-spy needs ptrace rights over the server (root, or kernel.yama.ptrace_scope=0)")
    report = {"machine": machine(), "load": vars(LOAD), "results": {}}
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        report["results"][engine] = profile(engine, folder, args.seconds)
    print(format_profile(report))
    if args.json:
        write_report(args.json, report)
    return 0
