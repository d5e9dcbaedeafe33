"""The capstone's tables and plot: every server on every traffic, and the decision read from them.

``labsupport.bench.capstone`` measures (``python -m labsupport bench capstone``) and saves the run as
package data; this module only reads a run and shows it, so a notebook can show the saved table in a
second and a rerun the same way.
"""
from __future__ import annotations

import math

import numpy as np

HEADLINE_NAMES = {"output_tok_s": "output tok/s", "slo_attainment": "SLO met", "tpot_p50_ms": "TPOT P50 ms",
                  "tpot_p90_ms": "TPOT P90 ms", "e2el_p50_ms": "answer P50 ms"}


def _fmt(v, spec=".1f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _headline(metric: str, v) -> str:
    return _fmt(100 * v, ".0f") + " %" if metric == "slo_attainment" and v is not None else _fmt(v)


def caption(r: dict) -> str:
    m = r["machine"]
    return (f"{r['model']} on {m.get('cpu', 'this machine')} ({m.get('cores', '?')} cores), {r['date']}; "
            f"${r['usd_per_hour']:.2f}/hour for the machine; each server alone, the same requests over HTTP")


def format_full(r: dict) -> str:
    """One block per traffic: every server's throughput, cost, latencies and SLO attainment."""
    out = [caption(r)]
    head = f"{'server':28} {'tok/s':>7} {'$/Mtok':>7} {'TTFT P50':>9} {'TTFT tail':>15} {'TPOT P50':>9} " \
           f"{'TPOT P90':>9} {'answer P50':>11} {'SLO met':>8} {'hit':>5}"
    for t in r["traffics"]:
        out += ["", f"{t['name']} ({t['requests']} requests, {t['prompt_tokens_mean']:.0f} prompt tokens on average, "
                    f"{t['output_tokens']} output tokens; rate "
                    f"{'all at once' if t['rate'] in (math.inf, 'inf', None) else t['rate']}"
                    f"{'' if t['burstiness'] == 1 else ', burstiness ' + str(t['burstiness'])}; "
                    f"SLO TTFT <= {t['ttft_ms']:.0f} ms, TPOT <= {t['tpot_ms']:.0f} ms)", head]
        for c in r["columns"]:
            x = c.get("traffic", {}).get(t["name"])
            if x is None:
                out.append(f"{c['name']:28} not measured: {c.get('skipped', 'left out')}"[:140])
                continue
            short = f"  ({x['output_tokens']}/{x['requested_tokens']} tokens: stopped at EOS)" \
                if x["output_tokens"] < x["requested_tokens"] else ""
            failed = f"  {x['requests'] - x['completed']} FAILED: {x['errors'][:1]}" if x["completed"] < x["requests"] \
                else ""
            out.append(f"{c['name']:28} {_fmt(x['output_tok_s']):>7} {_fmt(x['usd_per_mtok'], '.2f'):>7} "
                       f"{_fmt(x['ttft_p50_ms'], '.0f'):>9} {_fmt(x['ttft_tail_ms'], '.0f'):>9} "
                       f"{'(' + x['ttft_tail_label'] + ')':>5} {_fmt(x['tpot_p50_ms'], '.0f'):>9} "
                       f"{_fmt(x.get('tpot_p90_ms'), '.0f'):>9} {_fmt(x.get('e2el_p50_ms'), '.0f'):>11} "
                       f"{_fmt(100 * x['slo_attainment'], '.0f') + ' %':>8} "
                       f"{_fmt(x['prefix_cache_hit_rate'], '.2f'):>5}{short}{failed}")
    return "\n".join(out)


def format_decision(r: dict) -> str:
    """Traffic x technique: 'pays 1.8x' / 'costs 0.7x' / '~' on the traffic's headline (all vs all - X)."""
    rows = r["decision"]
    techs = list(rows[0]["techniques"]) if rows else []
    out = [f"What each technique does to each traffic's headline (all vs all - technique; pays/costs: more than "
           f"{100 * r['pays_above']:.0f} % better/worse, one run per cell; idle: no prefix shared, nothing to reuse)",
           f"{'traffic':22} {'headline':13} " + " ".join(f"{t[:18]:>18}" for t in techs)
           + f" {'best of ours':>32} {'vs transformers':>16} {'vs vLLM':>8}"]
    for row in rows:
        cells = [f"{v['verdict']} {_fmt(v['x'], '.2f')}x" for v in row["techniques"].values()]
        out.append(f"{row['traffic']:22} {HEADLINE_NAMES.get(row['headline'], row['headline']):13} "
                   + " ".join(f"{c:>18}" for c in cells)
                   + f" {row['best_ours'] or '-':>32} {_fmt(row['best_vs_transformers'], '.2f') + 'x':>16}"
                     f" {_fmt(row['best_vs_vllm'], '.2f') + 'x':>8}")
    return "\n".join(out)


def plot_capstone(r: dict):
    """Left: the decision as a heat map (green pays, red costs, log scale). Right: our best configuration
    per traffic against transformers serve and vLLM on the same headline (above 1: ours better)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    rows = r["decision"]
    techs = list(rows[0]["techniques"])
    x = np.array([[row["techniques"][t]["x"] if row["techniques"][t]["verdict"] not in ("idle", "?") else 1.0
                   for t in techs] for row in rows], dtype=float)  # idle cells stay neutral: their change is noise
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
    lx = np.log2(np.where(np.isfinite(x) & (x > 0), x, 1.0))
    lim = max(0.5, float(np.nanmax(np.abs(lx))))
    a.imshow(lx, cmap="RdYlGn", norm=TwoSlopeNorm(0, -lim, lim), aspect="auto")
    a.set_xticks(range(len(techs)), [t.replace(" ", "\n", 1) for t in techs], fontsize=8)
    a.set_yticks(range(len(rows)), [f"{row['traffic']}\n({HEADLINE_NAMES.get(row['headline'], row['headline'])})"
                                    for row in rows], fontsize=8)
    for i, row in enumerate(rows):
        for j, t in enumerate(techs):
            v = row["techniques"][t]
            a.text(j, i, f"{v['verdict']}\n{_fmt(v['x'], '.2f')}x", ha="center", va="center", fontsize=8)
    a.set_title("turning each technique on (all vs all - it)", fontsize=10)
    names = [row["traffic"] for row in rows]
    pos = np.arange(len(rows))
    for k, (key, label, color) in enumerate((("best_vs_transformers", "vs transformers serve", "tab:orange"),
                                             ("best_vs_vllm", "vs vllm serve", "tab:purple"))):
        vals = [row[key] if row[key] == row[key] and row[key] is not None else 0 for row in rows]
        b.barh(pos + (k - 0.5) * 0.38, vals, 0.38, label=label, color=color)
        for p, v in zip(pos, vals):
            b.text(v, p + (k - 0.5) * 0.38, f" {v:.2f}x" if v else " not measured", va="center", fontsize=7)
    b.axvline(1, color="k", lw=0.8)
    b.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter
    b.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    b.xaxis.set_minor_formatter(NullFormatter())
    b.set_yticks(pos, names, fontsize=8)
    b.invert_yaxis()
    b.set_xlabel("our best configuration's headline / theirs (>1: ours better)")
    b.legend(fontsize=8, loc="lower right")
    b.set_title("the course engine against the servers people use", fontsize=10)
    fig.suptitle(caption(r), fontsize=8)
    fig.tight_layout()
    return fig
