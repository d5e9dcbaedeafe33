"""The capstone's tables and plot: every server on every traffic, and the decision read from them.

``labsupport.experiments.capstone`` measures (``python -m labsupport bench capstone``) and saves the run as
package data; this module only reads a run and shows it, so a notebook can show the saved table in a
second and a rerun the same way.
"""
from __future__ import annotations

import math

import numpy as np

from ..machine import describe_machine

HEADLINE_NAMES = {"output_tok_s": "output tok/s", "slo_attainment": "SLO met", "tpot_p50_ms": "TPOT P50 ms",
                  "tpot_p90_ms": "TPOT P90 ms", "e2el_p50_ms": "answer P50 ms"}


def _fmt(v, spec=".1f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _headline(metric: str, v) -> str:
    if v is None:
        return "-"
    return _fmt(100 * v, ".0f") + " %" if metric == "slo_attainment" else _fmt(v, ".0f") + " ms" \
        if metric.endswith("_ms") else _fmt(v)


def caption(r: dict) -> str:
    return (f"{r['model']} on {describe_machine(r['machine'])}, {r['date']}; "
            f"${r['usd_per_hour']:.2f}/hour for the machine; each server alone, the same requests over HTTP")


SAMPLE_NAMES = {"ms_per_token": "each request's time per output token", "slo_met": "each request's SLO met or not",
                "e2el_ms": "each request's time to the whole answer", "tpot_ms": "each request's TPOT"}


def _range(b: dict) -> str:
    return f"{b['low']:.2f}-{b['high']:.2f}x (n = {b['n']:,})"


def rule_line(r: dict) -> str:
    """How the verdicts were drawn: each traffic's A/A band and the per-request sample it reads, or, for a run
    without them, that its cells are ratios with no verdict."""
    banded = [b for b in r["bands"] if b["band"]]
    if not banded:
        whys = sorted({b["why_none"] for b in r["bands"] if b["why_none"]})
        return (f"one run per cell, and this run has {' and '.join(whys) or 'no A/A band'}: "
                "ratios only, one run each, no verdict")
    samples = sorted({SAMPLE_NAMES.get(b["sample"], b["sample"]) for b in banded})
    whys = {}  # why -> the traffics without a band for that reason, in table order
    for b in r["bands"]:
        if not b["band"]:
            whys.setdefault(b["why_none"], []).append(b["traffic"])
    missing = [f"{_where(names)} ({why})" for why, names in whys.items()]
    return ("a word only where the 95 % bootstrap interval of the ratio, paired by request (" + "; ".join(samples)
            + "), lies outside that traffic's A/A band, all against all (again): "
            + "; ".join(f"{b['traffic']} {_range(b['band'])}" for b in banded) + "; else level"
            + (f"; no band, so ratios only, on {'; '.join(missing)}" if missing else "") + "; one run per cell")


def _cell(v: dict) -> str:
    x = "-" if v["x"] != v["x"] else f"{v['x']:.2f}x"  # nan: a column not measured
    return f"{v['verdict']} {x}" if v["verdict"] else x


def format_full(r: dict) -> str:
    """One block per traffic: every server's throughput, cost, latencies and SLO attainment."""
    out = [caption(r)]
    head = f"{'server':28} {'tok/s':>7} {'$/Mtok':>7} {'TTFT P50':>9} {'TTFT tail':>15} {'TPOT P50':>9} " \
           f"{'TPOT P90':>9} {'answer P50':>11} {'SLO met':>8} {'hit':>5}"
    for t in r["traffics"]:
        out += ["", f"{t['name']} ({t['requests']} requests, {t['prompt_tokens_mean']:.0f} prompt tokens on average, "
                    f"{t['output_tokens']} output tokens; rate "
                    f"{'all at once' if t.get('at_once') else t.get('rate', 'not recorded')}"
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
    """Traffic x technique: 'pays 1.8x' / 'costs 0.7x' / 'level 1.1x' on the traffic's headline (all vs all - X),
    then all against transformers and vLLM ('ahead' / 'behind' / 'level'); a bare '1.8x' where the run has no A/A
    band (one run each, no verdict)."""
    rows = r["decision"]
    techs = list(rows[0]["techniques"]) if rows else []
    cell = _cell
    heads = techs + ["all vs transformers", "all vs vLLM"]
    cells = [[cell(v) for v in row["techniques"].values()] + [cell(row["ours_vs_transformers"]),
                                                              cell(row["ours_vs_vllm"])] for row in rows]
    # each column as wide as its header or its widest cell: a header is never cut
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    out = [f"What each technique does to each traffic's headline (all vs all - technique; idle: no prefix shared, "
           f"nothing to reuse). "
           + ("Pays/costs/level, ahead/behind/level: " if any(b["band"] for b in r["bands"]) else "Ratios: ")
           + rule_line(r),
           f"{'traffic':22} {'headline':13} " + "  ".join(f"{h:>{w}}" for h, w in zip(heads, widths))]
    for row, line in zip(rows, cells):
        out.append(f"{row['traffic']:22} {HEADLINE_NAMES.get(row['headline'], row['headline']):13} "
                   + "  ".join(f"{c:>{w}}" for c, w in zip(line, widths)))
    return "\n".join(out)


def text_color(rgba) -> str:
    """Black or white, whichever contrasts more with a cell of colour ``rgba`` (WCAG 2's contrast ratio of
    relative luminances: the two tie at a luminance of about 0.18), so no label is dark on dark green."""
    def linear(c):
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (linear(c) for c in rgba[:3])
    return "white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.179 else "black"


def plot_capstone(r: dict):
    """Left: the decision as a heat map (green pays, red costs, log scale; a cell without a verdict stays
    neutral, its ratio written in it). Right: `all` per traffic against transformers serve and vLLM on the same
    headline (above 1: ours better), each bar labelled with its verdict or "no verdict"."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    rows = r["decision"]
    techs = list(rows[0]["techniques"])
    x = np.array([[row["techniques"][t]["x"] if row["techniques"][t]["verdict"] in ("pays", "costs") else 1.0
                   for t in techs] for row in rows], dtype=float)  # idle, level and unjudged cells stay neutral
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
    lx = np.log2(np.where(np.isfinite(x) & (x > 0), x, 1.0))
    lim = max(0.5, float(np.nanmax(np.abs(lx))))
    image = a.imshow(lx, cmap="RdYlGn", norm=TwoSlopeNorm(0, -lim, lim), aspect="auto")
    a.set_xticks(range(len(techs)), [t.replace(" ", "\n", 1) for t in techs], fontsize=8)
    a.set_yticks(range(len(rows)), [f"{row['traffic']}\n({HEADLINE_NAMES.get(row['headline'], row['headline'])})"
                                    for row in rows], fontsize=8)
    for i, row in enumerate(rows):
        for j, t in enumerate(techs):
            v = row["techniques"][t]
            label = f"{v['verdict']}\n{_fmt(v['x'], '.2f')}x" if v["verdict"] else f"{_fmt(v['x'], '.2f')}x\none run"
            a.text(j, i, label, ha="center", va="center", fontsize=8,
                   color=text_color(image.cmap(image.norm(lx[i, j]))), gid="capstone-cell")
    names = [row["traffic"] for row in rows]
    pos = np.arange(len(rows))
    for k, (key, label, color) in enumerate((("ours_vs_transformers", "vs transformers serve", "tab:orange"),
                                             ("ours_vs_vllm", "vs vllm serve", "tab:purple"))):
        vals = [row[key]["x"] if row[key]["x"] == row[key]["x"] else 0 for row in rows]
        b.barh(pos + (k - 0.5) * 0.38, vals, 0.38, label=label, color=color)
        for p, v, row in zip(pos, vals, rows):
            word = row[key]["verdict"] or "no verdict"
            b.text(v, p + (k - 0.5) * 0.38, f" {word} {v:.2f}x" if v else " not measured", va="center", fontsize=7)
    b.axvline(1, color="k", lw=0.8)
    b.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter
    finite = [v for row in rows for key in ("ours_vs_transformers", "ours_vs_vllm")
              for v in [row[key]["x"]] if v == v and v > 0] or [1.0]
    lo, hi = min(min(finite), 1.0) / 1.5, max(max(finite), 1.0) * 1.5
    b.set_xlim(lo, hi)
    b.set_xticks([t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16) if lo <= t <= hi])
    b.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    b.xaxis.set_minor_formatter(NullFormatter())
    b.set_yticks(pos, names, fontsize=8)
    b.invert_yaxis()
    b.set_xlabel("our 'all' headline / theirs (>1: ours better)")
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    b.set_title("the course engine (all) against the servers people use", fontsize=10)
    judged = any(b["band"] for b in r["bands"])
    a.set_title("turning each technique on (all vs all - it); "
                + ("a word only outside the A/A band" if judged else "one run each: ratios, no verdict"), fontsize=10)
    fig.suptitle(caption(r), fontsize=8)
    fig.tight_layout()
    return fig


def _where(items: list[str]) -> str:
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1] if items else ""


def reading(r: dict) -> str:
    """The decision table in sentences, every figure from the run (Markdown bullets); a verdict word only where
    ``capstone.decision`` drew one, else the ratio, one run each."""
    rows = r["decision"]
    cells = {c["name"]: c.get("traffic", {}) for c in r["columns"]}

    def value(col: str, row: dict) -> str:
        return _headline(row["headline"], cells.get(col, {}).get(row["traffic"], {}).get(row["headline"]))

    def sentence(subject: str, judged: list, other_col) -> str:
        def hit(row, v):
            return (f"{row['traffic']} ({HEADLINE_NAMES.get(row['headline'], row['headline'])} {value('all', row)} "
                    f"against {value(other_col(row), row)}, {_fmt(v['x'], '.2f')}x)")
        parts = []
        for word in dict.fromkeys(v["verdict"] for _, v in judged):
            these = [(row, v) for row, v in judged if v["verdict"] == word]
            if word == "idle":
                parts.append(f"idle (no prefix shared) on {_where([row['traffic'] for row, _ in these])}")
            elif word is None:
                parts.append(f"one run each, no verdict: {_where([hit(row, v) for row, v in these])}")
            elif word == "level":
                parts.append(f"level (inside the A/A band) on {_where([hit(row, v) for row, v in these])}")
            else:
                parts.append(f"{word} on {_where([hit(row, v) for row, v in these])}")
        return f"* **{subject}**: " + "; ".join(parts) + "."

    lines = []
    for tech in rows[0]["techniques"] if rows else []:
        lines.append(sentence(tech, [(row, row["techniques"][tech]) for row in rows], lambda row, t=tech: f"all - {t}"))
    for key, name in (("transformers", "transformers serve"), ("vllm", "vllm serve")):
        judged = [(row, v) for row in rows for v in [row[f"ours_vs_{key}"]] if v["x"] == v["x"]]  # nan: not measured
        if judged:
            lines.append(sentence(f"all against `{name}`", judged, lambda row, n=name: n))
    first = r["traffics"][0]["name"] if r["traffics"] else None
    on, off = cells.get("all", {}).get(first), cells.get("all - continuous batching", {}).get(first)
    if on and off:
        moves = ", ".join(f"{label} {_fmt(off.get(key), spec)} → {_fmt(on.get(key), spec)}{unit}"
                          for label, key, spec, unit in (("output tok/s", "output_tok_s", ".1f", ""),
                                                         ("TPOT P50", "tpot_p50_ms", ".0f", " ms"),
                                                         ("TTFT P50", "ttft_p50_ms", ".0f", " ms")))
        lines.append(f"* **Turning continuous batching on, {first}** (one run each): {moves}.")
    lines.append(f"* The rule: {rule_line(r)}.")
    return "\n".join(lines)


def slide_caption(r: dict) -> str:
    """The figure's caption for a deck: the rule, the run's size and where and when it was measured."""
    servers = sum("traffic" in c for c in r["columns"])
    return (f"Each cell: everything on against everything on but that technique, on the traffic's headline; "
            f"{rule_line(r)}. Right: all against `transformers serve` and `vllm serve`, by the same rule. "
            f"`python -m labsupport bench capstone`: {servers} servers x {len(r['traffics'])} traffics in "
            f"{r['seconds'] / 60:.0f} min on {describe_machine(r['machine'])}, {r['date']}, "
            f"${r['usd_per_hour']:.2f}/hour.")
