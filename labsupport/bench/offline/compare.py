"""``bench compare``: our engine, Hugging Face transformers and vLLM on identical work, on this machine.

Claims like "our engine is N x slower than vLLM" mean something only when every engine gets the
same token ids, the same lengths (greedy, ``ignore_eos``: each request makes exactly its
``max_tokens``) and the same clock, with start-up and warm-up left out. This module runs the
workloads of ``workload.comparison_workloads`` through each engine's runner, checks that the
engines' greedy tokens agree (fp32: they should, nearly always), measures the machine's roofline
(``roofline.py``) and says what fraction of the floor each engine reached, prints one table, and
writes everything, with the machine and the versions, to ``--json`` (a bar chart to ``--plot``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ...machine import machine
from ..lab import roofline
from ..summary import write_report
from . import engine_runner, hf_baseline, vllm_runner
from .workload import COMPARISON_WORKLOADS, comparison_workloads, warmup_prompts

ENGINES = ("labsupport", "transformers", "vllm")
AGREEMENT_PROMPTS = 4


def add_arguments(p):
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {','.join(ENGINES)}")
    p.add_argument("--workloads", default=",".join(COMPARISON_WORKLOADS),
                   help="comma-separated: W0 (1 request, TPOT), W1 (32 x 200 tokens, 128 out), WV (48 varied), "
                        "W3 (16 sharing a 600-token prefix)")
    p.add_argument("--quick", action="store_true", help="tiny versions of every workload (tests, smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", default=None, help="write every figure, the machine and versions")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart of output tokens/s")
    p.add_argument("--vllm-python", default=None, help="Python of the vLLM venv (default: .venv-vllm/bin/python)")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds before the vLLM run is abandoned")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline measurement (~10 s)")
    p.add_argument("--cpu-decode-kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="our engine reads K/V in place with the compiled C++ kernels (kernels/cpu_attention.py; "
                        "the default); --no-cpu-decode-kernel measures the PyTorch paths")


def _split(value: str, allowed, what: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"unknown {what} {bad or value!r}: choose from {','.join(allowed)}")
    return names


def agreement(ours: dict, other: list[list[int]]) -> dict:
    """How many prompts whose greedy tokens match, each compared over the other engine's length."""
    pairs = list(zip(ours, other))
    firsts = [next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None) for mine, theirs in pairs]
    return {"prompts": len(pairs), "agree": sum(f is None for f in firsts), "tokens_compared": [len(t) for t in other],
            "first_mismatch": firsts}


def run(args, argv=None) -> dict:
    engines = _split(args.engines, ENGINES, "engines")
    names = _split(args.workloads, COMPARISON_WORKLOADS, "workloads")
    from transformers import AutoTokenizer

    from ...models.loader import resolve_model_path

    folder = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    workloads = comparison_workloads(tokenizer, names, quick=args.quick, seed=args.seed)
    warmup = warmup_prompts(tokenizer)
    # a hub id as given; a folder by its name only (a saved report should not carry this machine's paths)
    model_name = args.model if args.model and not os.path.isdir(args.model) else os.path.basename(
        os.path.normpath(str(folder)))
    report = {"command": "python -m labsupport " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "model": model_name, "quick": args.quick,
              "workloads": {n: w.summary() for n, w in workloads.items()}, "results": {}, "agreement": {}}
    report["machine"]["other_runnable_threads"] = roofline.warn_if_busy()
    if not args.no_roofline:
        print("measuring the roofline ...", flush=True)
        report["roofline"] = roofline.measure(folder, quick=args.quick)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    w1 = workloads.get("W1")
    check = w1.prompts[:AGREEMENT_PROMPTS] if w1 else []
    check_len = min(32, w1.max_tokens[0]) if w1 else 0
    for engine in engines:
        started = time.perf_counter()
        if engine == "labsupport":
            options = {"cpu_decode_kernel": args.cpu_decode_kernel}
            report["machine"]["labsupport_options"] = options
            report["results"][engine] = engine_runner.run(folder, workloads, warmup, log=log, **options)
        elif engine == "transformers":
            report["results"][engine] = hf_baseline.run(folder, workloads, warmup, check, check_len, log=log)
        else:
            report["results"][engine] = vllm_runner.run(folder, workloads, warmup, args.vllm_python,
                                                        args.vllm_timeout, log=log)
            report["machine"]["vllm"] = report["results"][engine].get("vllm_version")
        log(f"  {engine}: {time.perf_counter() - started:.0f} s in all (load, warm-up and checks included)")
    ours = report["results"].get("labsupport", {})
    if w1 and "W1" in ours:
        mine = [t[:check_len] for t in ours["W1"]["first_tokens"]]
        hf = report["results"].get("transformers", {})
        if "agreement_tokens" in hf:
            report["agreement"]["transformers"] = agreement(mine, hf.pop("agreement_tokens"))
        if "W1" in report["results"].get("vllm", {}):
            theirs = [t[:check_len] for t in report["results"]["vllm"]["W1"]["first_tokens"]]
            report["agreement"]["vllm"] = agreement(mine, theirs)
    report["ratios"] = {name: {f"labsupport/{e}": ours[name]["output_tok_s"] / r[name]["output_tok_s"]
                               for e, r in report["results"].items() if e != "labsupport" and name in r}
                        for name in workloads if name in ours}
    if "roofline" in report:
        report["roofline_fraction"] = fractions(report["roofline"], report["results"], workloads)
    return report


def fractions(roof: dict, results: dict, workloads: dict) -> dict:
    """W0's TPOT against the B=1 floor; W1's decode throughput against the floor at its batch."""
    out = {}
    for engine, res in results.items():
        f = {}
        def context(w):  # mean cached tokens per sequence while decoding
            return len(w.prompts[0]) + w.max_tokens[0] / 2

        if "W0" in res and res["W0"].get("tpot_ms"):
            f["W0_tpot"] = roofline.achieved(roof, res["W0"]["tpot_ms"] / 1e3, 1, context(workloads["W0"]))
        if "W1" in res and res["W1"].get("decode_tok_s"):
            w = workloads["W1"]
            f["W1_decode"] = roofline.achieved(roof, None, len(w.prompts), context(w), res["W1"]["decode_tok_s"])
        out[engine] = f
    return out


def format_report(report: dict) -> str:
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    lines = [f"{'workload':9}{'engine':14}{'req':>5}{'out tok':>9}{'wall s':>9}{'out tok/s':>11}{'TPOT ms':>9}"
             f"{'TTFT ms':>10}{'ours/this':>11}"]
    for name, spec in report["workloads"].items():
        for i, (engine, res) in enumerate(report["results"].items()):
            label = name if i == 0 else ""
            if "skipped" in res:
                lines.append(f"{label:9}{engine:14}  skipped: {res['skipped'].splitlines()[0]}")
                continue
            r = res[name]
            ratio = report["ratios"].get(name, {}).get(f"labsupport/{engine}")
            lines.append(f"{label:9}{engine:14}{spec['requests']:>5}{r['output_tokens']:>9}{r['wall_s']:>9.2f}"
                         f"{r['output_tok_s']:>11.1f}{num(r['tpot_ms'], '.1f'):>9}"
                         f"{num(r['median_ttft_ms'], '.0f'):>10}{(num(ratio, '.2f') + 'x') if ratio else '':>11}")
    if any(report["ratios"].values()):
        # each engine runs each workload once, so a ratio here has no interval and no A/A band: no verdict word
        lines.append("ours/this: our output tokens/s divided by this engine's (> 1: ours made more per second); "
                     "one run each: a ratio, no verdict")
    for engine, a in report["agreement"].items():
        lines.append(f"greedy agreement with {engine}: {a['agree']}/{a['prompts']} W1 prompts identical over "
                     f"{max(a['tokens_compared'], default=0)} tokens (first mismatch: {a['first_mismatch']})")
    if "roofline" in report:
        lines += ["", "roofline (measured now):", roofline.format_roofline(report["roofline"])]
        for engine, f in report.get("roofline_fraction", {}).items():
            parts = [f"{k}: {v:.0%} of the floor" for k, v in f.items() if v is not None]
            if parts:
                lines.append(f"  {engine:14}" + "; ".join(parts))
    return "\n".join(lines)


def plot(report: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    engines = [e for e, r in report["results"].items() if "skipped" not in r]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 4))
    width = 0.8 / max(1, len(engines))
    for j, engine in enumerate(engines):
        values = [report["results"][engine][n]["output_tok_s"] for n in names]
        offset = (j - (len(engines) - 1) / 2) * width
        bars = ax.bar([i + offset for i in range(len(names))], values, width, label=engine)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 10 else f"{v:.2g}" for v in values], fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tokens / s")
    m = report["machine"]
    quick = " (--quick: tiny workloads)" if report["quick"] else ""
    ax.set_title(f"Same token ids, greedy, fp32, {m['cores']} cores: {m['cpu']}{quick}", fontsize=9)
    if engines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args, argv=None) -> int:
    report = run(args, argv)
    print(format_report(report))
    if args.json:
        write_report(args.json, report)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
