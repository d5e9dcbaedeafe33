"""``bench serve-compare``: our server and ``vllm serve`` under clients nobody here wrote, in one run.

Offline ratios (``bench compare``) say how fast an engine is; users meet it behind its HTTP server,
through their own clients. So this starts each server in turn (never two at once: they would share
the two cores), each with its own defaults as a user would start it — ours in its two designs if asked
(``ours``: the engine core in its own process, the default; ``ours-thread``: ``--engine-in-process``;
``ours@N``: ours with a step budget of N tokens, e.g. ``ours@2048``, vLLM's own CPU default beside our 512) —
and drives it with the outside clients over the same workloads:

* ``vllm bench serve`` (vLLM's own client, from ``.venv-vllm``): prefill-heavy traffic all at once
  (``burst``: 64 prompts of 256 tokens, 64 out), decode-heavy traffic all at once (``decode``: 32
  prompts of 32 tokens, 256 out, a reasoning model's shape), and bursty arrivals (``bursty``: 48
  prompts, 2 req/s, gamma-distributed gaps of shape 0.5);
* guidellm (``.venv-clients``, ``make clients``): 16 concurrent streams of 256 in / 64 out;
* the ``openai`` SDK: one streamed chat behind 16 others, timing its first chunk and its first token
  (equal on a server whose first chunk carries its first token).

Every client counts output tokens from the server's ``usage`` or its own tokenizer and starts TTFT at
the first chunk, as users' clients do. The JSON says which machine, which date and which versions;
``format_table`` prints the rows side by side with ours / vLLM ratios. ``--guidellm-rounds N`` and
``--burst-rounds N`` add N rounds of guidellm alone or of the prefill-heavy burst alone, the servers
alternating and each started afresh, and print each round's ratio and their median: on two cores one run's
ratio moves by several per cent (``benchmarks/README.md`` has the runs), so a target near a ratio is read
from the median of rounds, not from one run.

    python -m labsupport bench serve-compare --json benchmarks/serve-compare-cpu-DATE.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...percentiles import percentile
from ..summary import write_report

ENGINES = ("ours", "ours-thread", "vllm")  # and "ours@N": ours with --max-num-batched-tokens N
BUDGET_ENGINE = re.compile(r"ours@([1-9][0-9]*)")
REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class VllmBenchLoad:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = math.inf
    burstiness: float = 1.0


LOADS = (VllmBenchLoad("burst", 64, 256, 64), VllmBenchLoad("decode", 32, 32, 256),
         VllmBenchLoad("bursty", 48, 256, 64, request_rate=2.0, burstiness=0.5))
QUICK_LOADS = (VllmBenchLoad("burst", 8, 64, 16), VllmBenchLoad("decode", 4, 16, 32),
               VllmBenchLoad("bursty", 6, 64, 16, request_rate=4.0, burstiness=0.5))
GUIDELLM = {"streams": 16, "requests": 48, "prompt_tokens": 256, "output_tokens": 64}
QUICK_GUIDELLM = {"streams": 4, "requests": 8, "prompt_tokens": 64, "output_tokens": 16}
MAX_MODEL_LEN = 2048
VLLM_METRICS = ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "duration")


def guidellm_bin() -> Path:
    return Path(os.environ.get("LABSUPPORT_GUIDELLM", REPO / ".venv-clients" / "bin" / "guidellm"))


def server_args(engine: str) -> list[str]:
    """Our server's flags for ``engine`` (``ours``, ``ours-thread``, ``ours@N``): its defaults, our context length,
    the served name ``smol``, and only what the engine's name says besides."""
    args = ["--served-model-name", "smol", "--max-model-len", str(MAX_MODEL_LEN)]
    if engine == "ours-thread":
        args.append("--engine-in-process")
    budget = BUDGET_ENGINE.fullmatch(engine)
    if budget:
        args += ["--max-num-batched-tokens", budget.group(1)]
    return args


def start_server(engine: str, folder: str):
    """The server as a user starts it (``server_args``; vLLM with its own defaults and our context length)."""
    if engine == "vllm":
        from ...servers import VllmServer
        return VllmServer(folder, max_model_len=MAX_MODEL_LEN).start()
    from ...pd.cluster import Worker
    return Worker(None, None, None, folder, server_args(engine), name=engine).start()


def run_vllm_bench(url: str, load: VllmBenchLoad, folder: str, timeout_s: float = 900) -> dict:
    """``vllm bench serve`` (openai-chat backend, as users point it at a chat server): its saved JSON."""
    from ...servers import client_env
    from ...servers import vllm_bin
    rate = "inf" if math.isinf(load.request_rate) else str(load.request_rate)
    with tempfile.TemporaryDirectory(prefix="labsupport-serve-compare-") as work:
        cmd = [str(vllm_bin("vllm")), "bench", "serve", "--backend", "openai-chat", "--endpoint",
               "/v1/chat/completions", "--base-url", url, "--model", "smol", "--tokenizer", folder,
               "--dataset-name", "random", "--random-input-len", str(load.input_len), "--random-output-len",
               str(load.output_len), "--num-prompts", str(load.num_prompts), "--request-rate", rate,
               "--burstiness", str(load.burstiness), "--ignore-eos", "--temperature", "0", "--seed", "0",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
               "--save-result", "--result-dir", work, "--result-filename", "result.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=client_env(), cwd=work)
        saved = Path(work) / "result.json"
        if proc.returncode != 0 or not saved.exists():
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        result = json.loads(saved.read_text())
    return {k: result.get(k) for k in VLLM_METRICS}


def run_guidellm(url: str, folder: str, shape: dict, timeout_s: float = 900) -> dict:
    """guidellm's concurrent profile: output tokens/s and its TTFT/ITL medians (it times TTFT at the first
    chunk with text)."""
    binary = guidellm_bin()
    if not binary.exists():
        return {"skipped": f"guidellm is not installed ({binary}; `make clients`)"}
    with tempfile.TemporaryDirectory(prefix="labsupport-guidellm-") as work:
        out = Path(work) / "out.json"
        cmd = [str(binary), "run", "--backend", f"kind=openai_http,target={url},model=smol,"
                                                 "request_format=/v1/chat/completions",
               "--tokenizer", f"kind=huggingface_auto,model={folder}",
               "--profile", f"kind=concurrent,streams={shape['streams']}",
               "--constraint", f"kind=max_requests,count={shape['requests']}",
               "--data", f"kind=synthetic_text,prompt_tokens={shape['prompt_tokens']},"
                         f"output_tokens={shape['output_tokens']}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=work)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def successful(name: str, stat: str = "mean"):
        value = metrics.get(name, {}).get("successful", {})
        return value.get(stat) if stat in value else value.get("percentiles", {}).get(stat)
    return {"output_throughput": successful("output_tokens_per_second"),
            "median_ttft_ms": successful("time_to_first_token_ms", "median"),
            "median_itl_ms": successful("inter_token_latency_ms", "median"),
            "completed": metrics.get("request_totals", {}).get("successful")}


def probe_first_chunk(url: str, background: int = 16, timeout_s: float = 300) -> dict:
    """One ``openai`` SDK stream behind ``background`` others: when its first chunk came, and when its first
    chunk with text came (TTFT as a UI would show it). A server whose first chunk is an empty role delta
    would report its first chunk long before its first token."""
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="EMPTY", timeout=timeout_s, max_retries=0)
    ask = dict(model="smol", max_tokens=64, temperature=0, extra_body={"ignore_eos": True})

    def load(i):
        client.chat.completions.create(messages=[{"role": "user", "content": f"Write story {i}. " * 40}], **ask)
    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(background)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    start, first_chunk, first_text = time.perf_counter(), None, None
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "Name a yellow fruit."}],
                                                stream=True, **ask):
        now = time.perf_counter()
        first_chunk = first_chunk or now
        if chunk.choices and chunk.choices[0].delta.content:
            first_text = now
            break
    for t in threads:
        t.join(timeout_s)
    return {"first_chunk_ms": 1000 * (first_chunk - start), "first_text_ms": 1000 * (first_text - start)}


def alternating_rounds(engines: list[str], rounds: int, folder: str, run, log=print, label: str = "guidellm") -> list[dict]:
    """``run(url)`` alone, ``rounds`` times per server, the servers alternating and each started afresh: the spread
    of a figure one run cannot settle (at 16 closed-loop guidellm streams the two servers are level, and the
    burst's ratio moved between runs and rounds on one VM), so one run of each says more about the
    moment than about the servers (``benchmarks/README.md`` has the runs). A round that fails (a server that does
    not start, a client that errors) is kept as ``{"error": ...}`` and the rounds go on: its pair is left out of
    the summary, and what the other rounds measured is not lost."""
    from ...pd.cluster import stop_all
    rows = []
    for i in range(rounds):
        for engine in engines:
            server = None
            try:
                server = start_server(engine, folder)
                got = run(server.url)
            except Exception as exc:  # noqa: BLE001 - one failed round must not lose the others
                got = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                if server is not None:
                    stop_all([server])
            rows.append({"round": i, "engine": engine, **got})
            log(f"  {label} round {i + 1}/{rounds}, {engine}: {got.get('output_throughput', got)}")
    return rows


def guidellm_rounds(engines: list[str], rounds: int, folder: str, shape: dict, log=print) -> list[dict]:
    """guidellm alone, ``rounds`` rounds (``alternating_rounds``)."""
    return alternating_rounds(engines, rounds, folder, lambda url: run_guidellm(url, folder, shape), log, "guidellm")


def burst_rounds(engines: list[str], rounds: int, folder: str, load: VllmBenchLoad, log=print) -> list[dict]:
    """``vllm bench serve``'s prefill-heavy burst alone, ``rounds`` rounds (``alternating_rounds``)."""
    return alternating_rounds(engines, rounds, folder, lambda url: run_vllm_bench(url, load, folder), log, "burst")


def rounds_summary(rows: list[dict], label: str = "guidellm alone") -> str:
    """Each round's ours / vLLM output tok/s and their median, a line for each of our engines in the rounds
    (``ours`` first); with ``vllm bench serve``'s rows also the medians of the rounds' P99 ITL. '' without
    vLLM and one of ours in a round."""
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r.get("output_throughput"):
            by_round.setdefault(r["round"], {})[r["engine"]] = r
    ours = sorted({e for v in by_round.values() for e in v if e != "vllm"}, key=lambda e: (e != "ours", e))
    lines = []
    for engine in ours:
        pairs = [(v[engine], v["vllm"]) for _, v in sorted(by_round.items()) if engine in v and "vllm" in v]
        if not pairs:
            continue
        ratios = [a["output_throughput"] / b["output_throughput"] for a, b in pairs]
        each = "; ".join(f"{a['output_throughput']:.1f} / {b['output_throughput']:.1f} = {a['output_throughput'] / b['output_throughput']:.2f}x"
                         for a, b in pairs)
        itl = ""
        if all(a.get("p99_itl_ms") and b.get("p99_itl_ms") for a, b in pairs):
            itl = (f"; median P99 ITL {percentile([a['p99_itl_ms'] for a, _ in pairs], 50):,.0f} ms against "
                   f"{percentile([b['p99_itl_ms'] for _, b in pairs], 50):,.0f} ms")
        lines.append(f"{label}, {len(pairs)} rounds ({engine} / vLLM output tok/s): {each}; "
                     f"median {percentile(ratios, 50):.2f}x{itl}")
    return "\n".join(lines)


def measure(engines: list[str], quick: bool = False, folder: str | None = None, log=print, rounds: int = 0,
            only_rounds: bool = False, burst: int = 0, round_engines: list[str] | None = None) -> dict:
    """The table's loads on each of ``engines`` (unless ``only_rounds``), then ``burst`` burst rounds and
    ``rounds`` guidellm rounds on ``round_engines`` (default: ``engines``)."""
    from ...models.loader import prepare_default_model
    from ...machine import machine
    folder = str(folder or prepare_default_model())
    loads, shape = (QUICK_LOADS, QUICK_GUIDELLM) if quick else (LOADS, GUIDELLM)
    from ...pd.cluster import stop_all
    results = {}
    for engine in [] if only_rounds else engines:
        log(f"{engine}: starting the server")
        server = start_server(engine, folder)
        try:
            rows = {}
            for load in loads:
                t = time.time()
                rows[load.name] = run_vllm_bench(server.url, load, folder)
                log(f"  vllm bench serve {load.name}: {rows[load.name]['output_throughput']:.1f} tok/s "
                    f"({time.time() - t:.0f} s)")
            rows["guidellm"] = run_guidellm(server.url, folder, shape)
            log(f"  guidellm: {rows['guidellm']}")
            rows["openai_probe"] = probe_first_chunk(server.url, background=shape["streams"])
            log(f"  openai SDK probe: {rows['openai_probe']}")
            results[engine] = rows
        finally:
            stop_all([server])
    report = {"machine": machine(), "loads": [vars(x) for x in loads], "guidellm_shape": shape, "results": results}
    if burst:
        report["burst_rounds"] = burst_rounds(round_engines or engines, burst, folder, loads[0], log)
    if rounds:
        report["guidellm_rounds"] = guidellm_rounds(round_engines or engines, rounds, folder, shape, log)
    return report


TABLE = [("burst", "output_throughput", "vllm bench serve, prefill-heavy burst: output tok/s", True),
         ("burst", "mean_ttft_ms", "  mean TTFT (ms)", False), ("burst", "mean_tpot_ms", "  mean TPOT (ms)", False),
         ("burst", "median_itl_ms", "  median ITL (ms)", False), ("burst", "p99_itl_ms", "  P99 ITL (ms)", False),
         ("decode", "output_throughput", "vllm bench serve, decode-heavy burst: output tok/s", True),
         ("decode", "p99_itl_ms", "  P99 ITL (ms)", False),
         ("bursty", "mean_tpot_ms", "vllm bench serve, bursty 2 req/s: mean TPOT (ms)", False),
         ("bursty", "median_itl_ms", "  median ITL (ms)", False), ("bursty", "mean_ttft_ms", "  mean TTFT (ms)", False),
         ("guidellm", "output_throughput", "guidellm, concurrent streams: output tok/s", True),
         ("openai_probe", "first_chunk_ms", "openai SDK behind the streams: first chunk (ms)", False),
         ("openai_probe", "first_text_ms", "  first token (ms)", False)]


def format_table(report: dict) -> str:
    """Rows side by side; the last column is ours / vLLM where higher is better, vLLM / ours where lower is.
    Then the rounds, if any (with ``--only-rounds``, only them)."""
    results = report["results"]
    engines, both = list(results), {"ours", "vllm"} <= set(results)
    lines = []
    if results:
        lines += ["| | " + " | ".join(engines) + (" | ours vs vLLM |" if both else " |"),
                  "|---" * (len(engines) + 1 + both) + "|"]
    for load, key, label, higher in TABLE if results else ():
        values = [results[e].get(load, {}).get(key) for e in engines]
        cells = ["-" if v is None else f"{v:,.1f}" for v in values]
        if both:
            a, b = results["ours"].get(load, {}).get(key), results["vllm"].get(load, {}).get(key)
            ratio = (a / b if higher else b / a) if a and b else None
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key, label in (("burst_rounds", "vllm bench serve burst alone"), ("guidellm_rounds", "guidellm alone")):
        summary = rounds_summary(report.get(key, []), label)
        if summary:
            lines.append(summary)
    m = report["machine"]
    lines.append(f"\n{m['date']}, {m['cpu']}, {m['cores']} cores; each server alone, its own defaults, "
                 f"max_model_len {MAX_MODEL_LEN}. Ratios above 1 favour ours.")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--engines", default="ours,vllm", help=f"comma-separated, of {','.join(ENGINES)} or ours@N "
                   "(ours with a step budget of N tokens)")
    p.add_argument("--quick", action="store_true", help="small loads: a smoke test of the whole pipeline")
    p.add_argument("--json", metavar="FILE", default=None, help="save the report (machine, date, every figure)")
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--guidellm-rounds", type=int, default=0, metavar="N",
                   help="then N guidellm-only rounds, the servers alternating, each started afresh (its spread)")
    p.add_argument("--burst-rounds", type=int, default=0, metavar="N",
                   help="then N rounds of the prefill-heavy burst alone, the servers alternating, each started afresh")
    p.add_argument("--rounds-engines", default=None, help="the rounds' servers (default: --engines)")
    p.add_argument("--only-rounds", "--only-guidellm-rounds", dest="only_rounds", action="store_true",
                   help="the rounds only, not the table's loads")


def parse_engines(text: str) -> list[str]:
    """``--engines``' list, each of ``ENGINES`` or ``ours@N``; ValueError naming what is not."""
    engines = list(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))  # each once: a result per name
    if not engines or any(e not in ENGINES and not BUDGET_ENGINE.fullmatch(e) for e in engines):
        raise ValueError(f"unknown engines {text!r}: choose from {','.join(ENGINES)} or ours@N (N tokens a step)")
    return engines


def main(args) -> int:
    engines = parse_engines(args.engines)
    round_engines = parse_engines(args.rounds_engines) if args.rounds_engines else engines
    if (args.guidellm_rounds < 0 or args.burst_rounds < 0
            or (args.only_rounds and not (args.guidellm_rounds or args.burst_rounds))):
        raise ValueError("--guidellm-rounds and --burst-rounds must be >= 0, and one > 0 with --only-rounds")
    if args.guidellm_rounds or args.burst_rounds:
        if "vllm" not in round_engines or len(round_engines) < 2:
            raise ValueError("the rounds compare with vLLM: --rounds-engines (or --engines) needs vllm and one of ours")
    elif args.rounds_engines:
        raise ValueError("--rounds-engines picks the rounds' servers: give --burst-rounds or --guidellm-rounds too")
    report = measure(engines, args.quick, args.model, rounds=args.guidellm_rounds, only_rounds=args.only_rounds,
                     burst=args.burst_rounds, round_engines=round_engines)
    print(format_table(report))
    if args.json:
        write_report(args.json, report)
    return 0
