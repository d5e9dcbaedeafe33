"""``python -m labsupport bench simulate``: ``bench``'s workloads on the real scheduler and a simulated clock.

    python -m labsupport bench simulate --profile h100-llama-3.1-8b --num-requests 1000 --rate 20 \\
        --input-len 512 --output-len 128 --max-num-seqs 256 --goodput ttft:500 tpot:50 --usd-per-hour 2.5
    python -m labsupport bench simulate --validate --num-requests 8 --input-len 64 --output-len 16
    python -m labsupport bench simulate --profile h100-llama-3.1-8b --layout 1P1D --link-gbps 25 \
        --link-latency-ms 0.05 --num-requests 200 --rate 8 --input-len 128 4096 --output-len 64 256
    python -m labsupport bench simulate --profile h100-llama-3.1-8b --replicas 2 --policy least_loaded ...

Every figure it prints is labelled "simulated, profile X"; ``--validate`` runs the same workload for real on this
machine (``--repeats`` times), fits the ``cpu`` profile around those runs (``validate.py`` says why), simulates the
workload on it and prints both with the relative error, the real runs' own spread and the cached profile's error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

from ..bench.summary import format_summary, write_report
from ..pd.routing import POLICIES


def add_arguments(p: argparse.ArgumentParser):
    from ..bench.workload_args import add_kv_arguments, add_workload_arguments
    add_workload_arguments(p)
    add_kv_arguments(p)
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"],
                   help="gamma: --rate with gaps of shape --burstiness (bench serve's arrival process)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, below 1 burstier (coefficient of variation 1/sqrt)")
    p.add_argument("--profile", default="cpu", help="cpu (fitted here, cached), a shipped GPU profile "
                                                    "(python -m labsupport.sim.profiles lists them) or a JSON file")
    p.add_argument("--recalibrate", action="store_true", help="fit the cpu profile again on this machine")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput and attainment, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    p.add_argument("--usd-per-hour", type=float, default=None, help="the machine's price: cost per 1M output tokens")
    p.add_argument("--stop-probability", type=float, default=0.0,
                   help="> 0: requests may end early (EOS drawn with this chance a token, seeded per request)")
    p.add_argument("--validate", action="store_true",
                   help="also run the workload for real on this machine and report the simulation's error")
    p.add_argument("--repeats", type=int, default=2, help="--validate: real runs of the workload (2+: the A/A band)")
    p.add_argument("--layout", default="colocated",
                   help="colocated (--replicas engines behind --policy) or xPyD: x prefill and y decode engines "
                        "(1P1D, 2P1D, 1P2D) behind the PD router, the prompt's KV over a link (sim/pd_cluster.py)")
    p.add_argument("--replicas", type=int, default=1, help="colocated: how many engines behind the router")
    p.add_argument("--policy", default="round_robin", choices=POLICIES,
                   help="colocated replicas: the router's policy (PD: prefill round robin, decode least loaded)")
    p.add_argument("--link-gbps", type=float, default=math.inf,
                   help="PD: the link's bandwidth in GB/s (1e9 bytes a second); default: free")
    p.add_argument("--link-latency-ms", type=float, default=0.0, help="PD: the latency each KV pull pays")
    p.add_argument("--json", metavar="FILE", default=None)


def engine_options(args) -> dict:
    return dict(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                cpu_offload_blocks=args.cpu_offload_blocks, scheduling_policy=args.scheduling_policy,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_num_batched_tokens=args.max_num_batched_tokens)


def build_workload(tokenizer, args):
    from ..bench.workload_args import workload_from_args
    from .simulate import with_gamma_arrivals
    workload, clock = workload_from_args(tokenizer, args)
    if args.arrival == "gamma":
        if args.workload != "poisson":
            raise ValueError("--arrival gamma applies to --workload poisson")
        workload = with_gamma_arrivals(workload, args.rate, args.burstiness, args.seed)
    return workload, clock


def format_simulation(s: dict) -> str:
    layout = f", {s['layout']} ({s['num_engines']} engines)" if "layout" in s else ""
    lines = [f"--- simulated, profile {s['profile']} ({s['profile_source']}){layout}: virtual time, not a measurement",
             format_summary(s),
             f"{'engine steps':28s}{s['engine_steps']}",
             f"{'tokens computed':28s}{s['tokens_computed']} ({s['prompt_tokens_computed']} prompt)",
             f"{'preemptions':28s}{s['num_preemptions']}"]
    if "kv_peak_blocks" in s:  # one engine; a cluster's are per engine, below
        lines.insert(-1, f"{'KV blocks peak / total':28s}{s['kv_peak_blocks']} / {s['kv_blocks_total']}")
    if "slo_attainment" in s:
        slo = " ".join(f"{k}:{v:g}" for k, v in s["slo"].items())
        lines.append(f"{'SLO attainment (' + slo + ') ':28s}{s['slo_attainment']:.1%}; goodput "
                     f"{s['request_goodput']:.2f} req/s")
    for name, e in s.get("engines", {}).items():
        lines.append(f"{name:28s}KV peak {e['kv_peak_blocks']} / {e['kv_blocks_total']} blocks; "
                     f"{e['engine_steps']} steps; {e['prompt_tokens_computed']} prompt tokens computed")
    if "kv_transfer_bytes" in s:
        lines.append(f"{'KV pulled':28s}{s['kv_transfers']} pulls, {s['kv_transfer_bytes'] / 1e9:.2f} GB; each "
                     f"P50 {s['p50_transfer_ms']:.2f} ms, P99 {s['p99_transfer_ms']:.2f} ms")
    if "usd_per_million_output_tokens" in s:
        lines.append(f"{'USD per 1M output tokens':28s}{s['usd_per_million_output_tokens']:.3f} "
                     f"(at {s['usd_per_hour']:g} USD/h)")
    return "\n".join(lines)


def main(args) -> int:
    from ..bench.serving.serve_cli import parse_goodput
    from ..bench.serving.serve_datasets import load_tokenizer
    from .profiles import load_profile
    from .simulate import simulate_run
    slo = parse_goodput(args.goodput)
    if args.stop_probability and not 0 <= args.stop_probability < 1:
        raise ValueError(f"--stop-probability must be in [0, 1), got {args.stop_probability}")
    options = engine_options(args)
    profile = load_profile(args.profile, recalibrate=args.recalibrate)
    workload, clock = build_workload(load_tokenizer(None), args)
    if args.layout != "colocated" or args.replicas > 1:
        if clock != "wall" or args.validate:
            raise ValueError("--layout/--replicas run on virtual seconds (not --clock steps) and without --validate")
        from .pd_cluster import simulate_pd_run
        link = {"bandwidth_gbps": args.link_gbps, "latency_ms": args.link_latency_ms}
        summary = simulate_pd_run(workload, profile, args.layout, args.replicas, slo, args.usd_per_hour,
                                  policy=args.policy, link=link, stop_probability=args.stop_probability,
                                  seed=args.seed, **options)[0]
    else:
        summary = simulate_run(workload, profile, slo=slo, usd_per_hour=args.usd_per_hour, clock=clock,
                               stop_probability=args.stop_probability, seed=args.seed, **options)[0]
    print(format_simulation(summary))
    left_out = ("subcommand", "json", "validate", "recalibrate", "repeats")
    result = {"simulated": summary, "workload": {k: v for k, v in vars(args).items() if k not in left_out}}
    if args.validate:
        from .validate import format_validation, validate
        check = validate({args.workload: workload}, repeats=args.repeats, clock=clock, **options)
        print(format_validation(check))
        result["validation"] = check
    if args.json:
        write_report(args.json, json.loads(json.dumps(result, default=_plain)))
    return 0


def _plain(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)
