"""``python -m labsupport bench serve``: the load generator's command line, ``vllm bench serve``'s flags.

    python -m labsupport bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 \\
        --random-input-len 128 --random-output-len 64 --request-rate 1 2 4 inf --plot knee.png

Several ``--request-rate`` values run one after the other against the same workload (a sweep):
the table at the end and ``--plot`` show where latency bends up. The same command drives
``vllm serve`` (give ``--model`` and, for a model other than the embedded one, ``--tokenizer``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from .serve_bench import CHAT, COMPLETIONS, BenchResult, benchmark
from .serve_datasets import DATASETS, load_tokenizer, sample_requests


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds), checked."""
    slo = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes KEY:MS pairs (ttft:500 tpot:50 e2el:2000), got {pair!r}") from None
        if name not in ("ttft", "tpot", "e2el") or slo[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the key is ttft, tpot or e2el and the value milliseconds >= 0")
    return slo


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--endpoint", default=CHAT, choices=[CHAT, COMPLETIONS])
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder or hub id whose tokenizer sizes the prompts (default: the embedded model's)")
    p.add_argument("--dataset-name", default="random", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=128, help="prompt tokens (after any shared prefix)")
    p.add_argument("--random-output-len", type=int, default=64, help="output tokens (max_completion_tokens)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--num-long", type=int, default=None, help="long-short: long prompts (default num-prompts/8)")
    p.add_argument("--long-input-len", type=int, default=1024, help="long-short: their length in tokens")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second; several values run a sweep; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="force every answer to its full length (default on: lengths are the workload's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    p.add_argument("--usd-per-hour", type=float, default=None, help="machine price: adds $ per 1M output tokens")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true", help="write each run's JSON")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None, help="(a sweep adds -<rate>qps before .json)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="latency vs throughput and TTFT/ITL CDFs")


def format_result(r: BenchResult) -> str:
    """vLLM's result block, so the two tools' outputs read side by side."""
    s, c = r.summary, r.config
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"])]
    if c["max_concurrency"]:
        rows.append(("Maximum request concurrency:", c["max_concurrency"]))
    rows += [("Request rate configured (RPS):", c["request_rate"]), ("Benchmark duration (s):", s["duration"]),
             ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
             ("Request throughput (req/s):", s["request_throughput"])]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s):", s["request_goodput"]))
    rows += [("Output token throughput (tok/s):", s["output_throughput"]),
             ("Total token throughput (tok/s):", s["total_token_throughput"])]
    if "usd_per_million_output_tokens" in s:
        rows.append(("Cost ($ / 1M output tokens):", s["usd_per_million_output_tokens"]))
    if "prefix_cache_hit_rate" in s:
        rows.append(("Prefix cache hit rate (server):", s["prefix_cache_hit_rate"]))
    if "mean_queue_time_ms" in s:
        rows.append(("Mean queue time (ms, server):", s["mean_queue_time_ms"]))
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<40} {v:<10.2f}" if isinstance(v, float) else f"{k:<40} {v:<10}" for k, v in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{:-^50}".format(title))
        for label in ("mean", "median", "p90", "p99"):
            lines.append(f"{label.capitalize() + ' ' + name.upper() + ' (ms):':<40} {s[f'{label}_{name}_ms']:<10.2f}")
    for err in s["first_errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines + ["=" * 50])


def format_sweep(results: list[BenchResult]) -> str:
    head = f"{'rate':>6} {'req/s':>7} {'tok/s':>8} {'P50 TTFT':>9} {'P99 TTFT':>9} {'P50 TPOT':>9} {'P99 E2E':>9}"
    has_good = "request_goodput" in results[0].summary
    lines = [head + (f" {'goodput':>8}" if has_good else "")]
    for r in results:
        s = r.summary
        line = (f"{r.config['request_rate']:>6g} {s['request_throughput']:>7.2f} {s['output_throughput']:>8.1f} "
                f"{s['median_ttft_ms']:>9.1f} {s['p99_ttft_ms']:>9.1f} {s['median_tpot_ms']:>9.1f} "
                f"{s['p99_e2el_ms']:>9.1f}")
        lines.append(line + (f" {s['request_goodput']:>8.2f}" if has_good else ""))
    return "\n".join(lines)


def result_path(args, model: str, rate: float, stamp: str) -> str:
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = f"serve-{rate:g}qps{conc}-{model.split('/')[-1]}-{stamp}.json"
    if args.result_filename:
        name = args.result_filename
        if len(args.request_rate) > 1:
            root, ext = os.path.splitext(name)
            name = f"{root}-{rate:g}qps{ext or '.json'}"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def first_model(base_url: str) -> str:
    import httpx
    from .serve_bench import auth_headers
    resp = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=10, headers=auth_headers())
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def main(args) -> int:
    import httpx
    try:
        return run(args)
    except (RuntimeError, httpx.HTTPError) as exc:  # server down, wrong model or endpoint: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    slo = parse_goodput(args.goodput)
    model = args.model or first_model(args.base_url)
    requests = sample_requests(load_tokenizer(args.tokenizer), args.dataset_name, args.num_prompts,
                               args.random_input_len, args.random_output_len, args.random_range_ratio,
                               args.prefix_len, args.num_long, args.long_input_len, args.seed)
    stamp, results = time.strftime("%Y%m%d-%H%M%S"), []
    for rate in args.request_rate:
        r = benchmark(args.base_url, model, requests, rate=rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                      temperature=args.temperature, slo=slo, usd_per_hour=args.usd_per_hour, seed=args.seed,
                      progress=not args.disable_tqdm, test_request=not results)
        r.config.update(dataset_name=args.dataset_name, date=stamp)
        results.append(r)
        print(format_result(r), flush=True)
        if args.save_result:
            path = result_path(args, model, rate, stamp)
            with open(path, "w") as f:
                json.dump(r.to_json(), f, indent=1)
            print(f"wrote {path}")
    if len(results) > 1:
        print(format_sweep(results))
    if args.plot:
        from .serve_plots import plot_results
        plot_results(results, args.plot, title=f"{model} - {args.dataset_name}, {args.num_prompts} prompts")
        print(f"wrote {args.plot}")
    return 1 if any(r.summary["failed"] for r in results) else 0


if __name__ == "__main__":  # python -m labsupport.bench.serving.serve_cli ...
    parser = argparse.ArgumentParser(prog="python -m labsupport bench serve")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
