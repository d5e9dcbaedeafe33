"""The course table ("what each chapter bought") as the notebooks and decks show it.

``labsupport.experiments.course_table`` measures it (``python -m labsupport bench course-table``) and saves it
as package data; this module only reads that run and draws it: a table of rows 00 .. the chapter (later
chapters left out, this chapter's row highlighted) with a caption saying when, where and at what price
it was measured, and a plot of cost per million output tokens beside goodput under bursty load.

Two layouts of the saved run are read. Schemas 2 and 3 (``"schema": 2`` or ``3``) measure every row under both gamma
(bursty) and Poisson arrivals with 100 requests each (schema 2: row 00 only its first few; 3: all of them):
the load columns then read "gamma / Poisson". A run
without the key is the first layout (24 requests, gamma only, row 07 with twice the KV): it is drawn as
before, and its caption says its tails are maxima and row 07 held more KV.
"""
from __future__ import annotations

import json
import math
import textwrap

import numpy as np

SAVED = "course_table_cpu.json"  # package data: the real run the notebooks show


def _fmt(v, spec=".2f", none="-"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _neighbour(r: dict) -> str:
    share = r.get("neighbour_cpu_share") or 0.0
    return f" [other processes took {100 * share:.0f} % of the cores meanwhile]" if share >= 0.05 else ""


def _incomplete(r: dict) -> str:
    """Which of the row's runs ended with requests unanswered (a row too slow for the load: they waited past
    ``bench serve``'s client timeout), as a note; its figures then come from the answered ones."""
    cut = [f"{name} {r[key]['completed']} of {r[key]['requests']}" for key, name in
           (("capacity", "capacity"), ("bursty", "gamma"), ("poisson", "Poisson"))
           if key in r and r[key].get("completed", 0) < r[key].get("requests", 0)]
    return (f" [answered: {', '.join(cut)}; the others waited past the client's timeout, and the figures are the "
            "answered requests']" if cut else "")


def _both(b: dict, p: dict, key: str, spec: str, scale: float = 1, suffix: str = "") -> str:
    """One load column as "gamma / Poisson" (the tail with its label after each)."""
    def one(run):
        v = run.get(key)
        tail = f" ({run['ttft_tail_label']})" if key == "ttft_tail_ms" else ""
        return _fmt(None if v is None else scale * v, spec) + suffix + tail
    return f"{one(b)} / {one(p)}"


def table_rows(rows_: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Column heads and cells of the table (the same for the terminal, markdown and HTML); rows measured
    under both arrival processes get "gamma / Poisson" in each load column."""
    both = any("bursty" in r and "poisson" in r for r in rows_)
    if both:
        head = ["ch.", "row", "tok/s", "$/Mtok", "cost vs 00", "goodput req/s gamma / Poisson",
                "SLO met gamma / Poisson", "TTFT P50 ms gamma / Poisson", "TTFT tail ms gamma / Poisson",
                "queue ms gamma / Poisson", "hit rate", "note"]
    else:
        head = ["ch.", "row", "tok/s", "$/Mtok", "cost vs 00", "goodput req/s", "SLO met", "TTFT P50 ms",
                "TTFT tail ms", "queue ms", "hit rate", "note"]
    cells = []
    for r in rows_:
        if "capacity" not in r:
            cells.append([r["chapter"], r["name"]] + ["-"] * 9 + [r["note"]])
            continue
        if "bursty" in r and "poisson" in r:
            c, b, p = r["capacity"], r["bursty"], r["poisson"]
            cells.append([r["chapter"], r["name"], _fmt(c["output_tok_s"], ".1f"), _fmt(c["usd_per_mtok"]),
                          _fmt(r.get("cost_vs_00"), ".3f"), _both(b, p, "goodput_req_s", ".2f"),
                          _both(b, p, "slo_attainment", ".0f", 100, " %"), _both(b, p, "ttft_p50_ms", ".0f"),
                          _both(b, p, "ttft_tail_ms", ".0f"), _both(b, p, "mean_queue_time_ms", ".0f"),
                          _fmt(b["prefix_cache_hit_rate"]), r["note"] + _incomplete(r) + _neighbour(r)])
            continue
        c, b = r["capacity"], r.get("bursty") or r.get("poisson")
        extra = f" (Poisson: goodput {_fmt(r['poisson']['goodput_req_s'])}, SLO met " \
                f"{_fmt(100 * r['poisson']['slo_attainment'], '.0f')} %)" if "poisson" in r and "bursty" in r else ""
        cells.append([r["chapter"], r["name"], _fmt(c["output_tok_s"], ".1f"), _fmt(c["usd_per_mtok"]),
                      _fmt(r.get("cost_vs_00"), ".3f"), _fmt(b and b["goodput_req_s"]),
                      _fmt(b and 100 * b["slo_attainment"], ".0f") + " %",
                      _fmt(b and b["ttft_p50_ms"], ".0f"),
                      f"{_fmt(b and b['ttft_tail_ms'], '.0f')} ({b['ttft_tail_label'] if b else '-'})",
                      _fmt(b and b["mean_queue_time_ms"], ".0f"), _fmt(b and b["prefix_cache_hit_rate"]),
                      r["note"] + extra + _incomplete(r) + _neighbour(r)])
    return head, cells


def format_rows(rows_: list[dict]) -> str:
    head, cells = table_rows(rows_)
    return "\n".join(" | ".join(row[:-1]) + "  " + row[-1] for row in [head, *cells])


def load(path=None) -> dict:
    """The saved run: the package's (None), a file, or a table already loaded (a dict)."""
    if isinstance(path, dict):
        return path
    if path is None:
        from ..data import text
        return json.loads(text(SAVED))
    with open(path) as f:
        return json.load(f)


def caption(t: dict) -> str:
    m = t["machine"]
    if t.get("schema", 1) >= 2:
        w, z = t["workload"], t["sizes"]
        load_ = " and ".join(f"{name} {w[key]['requests']} requests at {w[key]['rate']} req/s"
                             for key, name in (("bursty", f"gamma (shape {z['burstiness']})"), ("poisson", "Poisson"))
                             if key in w)
        return (f"Measured {t['date']} on {m['cpu']} ({m['cores']} cores, {m['device']}, torch {m['torch']}), "
                f"{t['model']}; help-desk chats: the handbook's opening lines (at least {z['system_tokens']} tokens) "
                f"as a system prompt every request shares, then one employee's question (prompts "
                f"{w['capacity']['prompt_tokens_mean']:.0f} tokens on average), answers of "
                f"{'/'.join(str(n) for n in z['output_lens'])} tokens; every row priced at "
                f"${t['usd_per_hour']:.2f}/hour; capacity {w['capacity']['requests']} requests at once; load: {load_}"
                + ("" if t.get("schema", 2) >= 3 else f" (row 00: its first {z.get('row00_requests')} only)") +
                f"; one KV budget for every row, "
                f"{z['kv_blocks']} blocks of {z['block_size']} tokens ({z['kv_bytes'] / 2**20:.1f} MiB; row 07's "
                f"two workers split it); SLOs TTFT <= {t['slo_ms']['ttft']:.0f} ms, "
                f"TPOT <= {t['slo_ms']['tpot']:.0f} ms; "
                f"tails are P99 with >= {t['min_p99_samples']} samples, else max.")
    return (f"Measured {t['date']} on {m['cpu']} ({m['cores']} cores, {m['device']}, torch {m['torch']}), "
            f"{t['model']}; every row priced at ${t['usd_per_hour']:.2f}/hour; bursty load "
            f"{t['workload']['bursty']['rate'] if 'bursty' in t['workload'] else '-'} req/s, gamma shape "
            f"{t['sizes']['burstiness']}; SLOs TTFT <= {t['slo_ms']['ttft']:.0f} ms, "
            f"TPOT <= {t['slo_ms']['tpot']:.0f} ms; "
            f"tails are P99 with >= {t['min_p99_samples']} samples, else max.")


class Table:
    """The table up to one chapter: HTML in a notebook, markdown as text."""

    def __init__(self, head, cells, chapter, caption_):
        self.head, self.cells, self.chapter, self.caption = head, cells, chapter, caption_

    @property
    def markdown(self) -> str:
        def line(c):
            return "| " + " | ".join(c) + " |"
        body = [line([f"**{x}**" for x in c] if c[0] == self.chapter else c) for c in self.cells]
        return "\n".join([line(self.head), line(["---"] * len(self.head)), *body, "", self.caption])

    def _repr_html_(self) -> str:
        import html
        mark = '<tr style="background:#fff3c4;font-weight:bold">'
        tr = [mark if c[0] == self.chapter else "<tr>" for c in self.cells]
        body = "".join(t + "".join(f"<td>{html.escape(x)}</td>" for x in c) + "</tr>" for t, c in zip(tr, self.cells))
        heads = "".join(f"<th>{html.escape(h)}</th>" for h in self.head)
        return (f"<table><caption style='caption-side:bottom'>{html.escape(self.caption)}</caption>"
                f"<thead><tr>{heads}</tr></thead><tbody>{body}</tbody></table>")

    __str__ = __repr__ = _repr_markdown_ = lambda self: self.markdown  # text/plain too: stable in saved notebooks


def show_course_table(chapter: str | int, path=None) -> Table:
    """Rows 00..``chapter`` of the saved run (later chapters left out), this chapter's highlighted."""
    t, chapter = load(path), f"{int(chapter):02d}"
    head, cells = table_rows([r for r in t["rows"] if r["chapter"] <= chapter])
    return Table(head, cells, chapter, caption(t))


def plot_course_table(chapter: str | int, ax=None, path=None):
    """Cost per million output tokens by chapter (bars), goodput under bursty load beside each, and under
    Poisson load too when every row shown was measured with both; returns the figure."""
    import matplotlib.pyplot as plt
    t, chapter = load(path), f"{int(chapter):02d}"
    rs = [r for r in t["rows"] if r["chapter"] <= chapter and "capacity" in r]
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(9, 4.2))
    cost = [r["capacity"]["usd_per_mtok"] for r in rs]
    good = [(r.get("bursty") or r.get("poisson") or {}).get("goodput_req_s", 0) for r in rs]
    both = all("bursty" in r and "poisson" in r for r in rs)
    poisson = [r["poisson"]["goodput_req_s"] for r in rs] if both else []
    x, w = np.arange(len(rs)), 0.28 if both else 0.4  # three bars per chapter with both arrival processes
    left = x - w if both else x - w / 2
    bars = ax.bar(left, cost, w, color=["tab:red" if r["chapter"] == chapter else "tab:gray" for r in rs],
                  label=f"\\$ per 1M output tokens (at \\${t['usd_per_hour']:.2f}/h, left, log)")
    ax.bar_label(bars, [f"\\${c:.2f}" for c in cost], fontsize=8)
    ax.set(yscale="log", ylabel="\\$ per 1M output tokens (log scale)", ylim=(min(cost) / 2, max(cost) * 3),
           xticks=x, xticklabels=[r["chapter"] + "\n" + "\n".join(textwrap.wrap(r["name"], 13, break_long_words=False))
                                  for r in rs])
    ax.tick_params(axis="x", labelsize=8)
    ax2 = ax.twinx()
    ax2.bar(left + w, good, w, color="tab:blue", alpha=0.7, label="goodput under bursty load (req/s, right)")
    if both:
        ax2.bar(left + 2 * w, poisson, w, color="tab:cyan", alpha=0.8, label="goodput under Poisson load (req/s, right)")
    ax2.set(ylabel="goodput (requests/s meeting both SLOs)", ylim=(0, max(good + poisson + [0.1]) * 1.3))
    ax.set_title("What each chapter bought: cost per token and goodput, same workload, same machine")
    fig.legend(loc="upper center", ncol=3 if both else 2, fontsize=8, bbox_to_anchor=(0.5, 0.9))
    fig.text(0.01, 0.005, "\n".join(textwrap.wrap(caption(t).replace("$", "\\$"), 170)), fontsize=6.5, color="gray")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def what_it_bought(chapter: str | int, path=None) -> str:
    """One sentence from the saved run: this chapter's row against the row before it and against row 00."""
    t, chapter = load(path), f"{int(chapter):02d}"
    by = {r["chapter"]: r for r in t["rows"] if "capacity" in r}
    if chapter not in by:
        return f"Row {chapter} was not measured in this run."
    row = by[chapter]

    def figures(r):
        c, b = r["capacity"], r.get("bursty") or r.get("poisson") or {}
        return (f"{c['output_tok_s']:.1f} output tokens/s, ${c['usd_per_mtok']:.2f} per million output tokens, "
                f"goodput {b.get('goodput_req_s', math.nan):.2f} req/s with {100 * b.get('slo_attainment', math.nan):.0f} % "
                f"of requests within both SLOs")

    earlier = [c for c in by if c < chapter]
    if not earlier:
        return f"Row {chapter} ({row['name']}), the starting line: {figures(row)}."
    prev, first = by[earlier[-1]], by["00"] if "00" in by else None
    text = f"Row {chapter} ({row['name']}): {figures(row)}; row {prev['chapter']} ({prev['name']}): {figures(prev)}."
    if first is not None:  # row 01 too: its whole gain is against row 00, and the prose points at this factor
        ratio = first["capacity"]["usd_per_mtok"] / row["capacity"]["usd_per_mtok"]
        text += f" Against row 00, a million output tokens costs {ratio:.1f}x less."
    return text


# (run, key, label, unit, format): what what_moved compares, in the table's order
_MOVES = [("capacity", "output_tok_s", "output", "tok/s", ".1f"), ("capacity", "usd_per_mtok", "cost", "$/Mtok", ".2f"),
          ("bursty", "goodput_req_s", "goodput", "req/s", ".2f"), ("bursty", "slo_attainment", "SLO met", "%", ".0f"),
          ("bursty", "ttft_p50_ms", "TTFT P50", "ms", ".0f"), ("bursty", "mean_queue_time_ms", "queueing", "ms", ".0f"),
          ("poisson", "goodput_req_s", "goodput under Poisson arrivals", "req/s", ".2f"),  # schema 2 only
          ("poisson", "slo_attainment", "SLO met under Poisson arrivals", "%", ".0f")]


def what_moved(chapter: str | int, path=None) -> str:
    """One markdown sentence from the saved run: this chapter's row against the row before it, metric by metric, as
    figures and their ratio. Each row is one run, so no ratio carries a verdict word (``labsupport.measure``: a
    word needs an interval and an A/A band, which repeated rounds of the table would give); an unchanged figure
    is said to be the same."""
    t, chapter = load(path), f"{int(chapter):02d}"
    by = {r["chapter"]: r for r in t["rows"] if "capacity" in r}
    earlier = [c for c in by if c < chapter]
    if chapter not in by or not earlier:
        return f"Row {chapter} has no measured row before it to compare with."
    row, prev = by[chapter], by[earlier[-1]]
    moved, same = [], []
    for run, key, label, unit, spec in _MOVES:
        if run == "poisson" and not all("bursty" in r and "poisson" in r for r in (prev, row)):
            continue  # a Poisson-only run already stands in for the bursty lines above
        a, b = ((r.get(run) or r.get("poisson") or {}).get(key) for r in (prev, row))
        if a is None or b is None:
            continue
        scale = 100 if unit == "%" else 1
        a_, b_ = format(scale * a, spec), format(scale * b, spec)
        text = (f"{label} ${a_} → ${b_} per million output tokens" if unit == "$/Mtok"
                else f"{label} {a_} → {b_} {unit}")
        if a_ == b_:
            same.append(text)
        elif float(a_) and float(b_):
            moved.append(f"{text} ({b / a:.2f}×)")
        else:  # from or to (about) zero: no ratio to give
            moved.append(text)
    told = (f"Row {chapter} ({row['name']}) against row {prev['chapter']} ({prev['name']}), saved run of {t['date']}, "
            "one run each (figures and ratios, no verdict: one run has no interval to read against the noise): ")
    told += "; ".join(moved) if moved else "no figure changed"
    return told + (f"; the same: {'; '.join(same)}." if same else ".")
