"""The larger result plots of chapters 02-04, kept here so a notebook cell shows the idea, not the matplotlib.

Each function draws what the chapter measured (its rows or summaries, unchanged) and returns the
figure; the chapter passes the title and the footnote that name its workload and hardware.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..percentiles import tail


def _finish(fig, title: str, footnote: str, bottom: float = 0.05):
    fig.suptitle(title, fontweight="bold")
    fig.text(0.01, 0.005, footnote, fontsize=8, color="gray")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def plot_block_size_tradeoff(sweep: list[dict], chosen: int, footnote: str):
    """Chapter 02: fragmentation (what small blocks save) beside step time and block-table entries (what they
    cost). ``sweep``: rows with block_size, fragmentation (%), step_ms, step_quartiles_ms, table_entries."""
    sizes = [row["block_size"] for row in sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    left.plot(sizes, [row["fragmentation"] for row in sweep], "o-", color="tab:red", lw=2)
    for row in sweep:
        left.annotate(f"{row['fragmentation']:.1f}%", (row["block_size"], row["fragmentation"]),
                      textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    left.set(xscale="log", title="What small blocks save: internal fragmentation",
             xlabel="block size (tokens, log scale)", ylabel="reserved slots holding no token (%)")
    left.set_ylim(0, 1.2 * max(row["fragmentation"] for row in sweep))
    left.set_xlim(0.7, 180)
    right.errorbar(sizes, [row["step_ms"] for row in sweep], capsize=3, color="tab:blue", lw=2, marker="o",
                   yerr=[[row["step_ms"] - row["step_quartiles_ms"][0] for row in sweep],
                         [row["step_quartiles_ms"][1] - row["step_ms"] for row in sweep]],
                   label="decode step time, median and quartiles (left axis)")
    right.set(xscale="log", title="What they cost: metadata and time per step",
              xlabel="block size (tokens, log scale)", ylabel="decode step time (ms)")
    right.set_ylim(0, 1.35 * max(row["step_quartiles_ms"][1] for row in sweep))
    entries = right.twinx()
    entries.plot(sizes, [row["table_entries"] for row in sweep], "s--", color="tab:gray",
                 label="block-table entries per sequence (right axis)")
    entries.set(yscale="log", ylabel="block-table entries per sequence")
    right.legend(handles=[right.containers[0], entries.get_lines()[0]], loc="lower left", fontsize=8)
    for ax in (left, right):
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.axvline(chosen, color="gray", lw=0.8, ls=":")
    return _finish(fig, "The block-size trade-off", footnote)


# chapter 03: (c) and (c') are drawn with open markers on top, so they show where they coincide with (b) and (a)
CACHE_STYLES = {"a": dict(color="tab:red", marker="o", ls="-"), "b": dict(color="tab:blue", marker="s", ls="-"),
                "c": dict(color="tab:green", marker="^", ls="-", mfc="none", mew=1.8, ms=10),
                "c'": dict(color="tab:orange", marker="v", ls="--", mfc="none", mew=1.8, ms=10),
                "d": dict(color="tab:gray", marker="D", ls=":")}


def plot_cache_levels(runs: dict, names: dict, title: str, footnote: str):
    """Chapter 03: TTFT and prompt tokens computed per request, for each cache level. ``runs``: level key ->
    rows with ttft (s) and prompt_tokens_computed; ``names``: level key -> legend label ("d" is a whole answer)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    label = {k: names[k] + (" (whole answer)" if k == "d" else "") for k in runs}
    for key in ["a", "b", "c'", "c", "d"]:
        rows, style = runs[key], {"ms": 6, "lw": 1.6, **CACHE_STYLES[key]}
        x = range(1, len(rows) + 1)
        left.plot(x, [r["ttft"] for r in rows], label=label[key], **style)
        right.plot(x, [r["prompt_tokens_computed"] for r in rows], label=label[key], **style)
    left.set(yscale="log", title="Time to first token", xlabel="request (sent one after another)",
             ylabel="TTFT (s, log scale)")
    right.set(title="Prompt tokens the engine actually computed", xlabel="request (sent one after another)",
              ylabel="prompt tokens computed")
    first = runs["b"][0]["prompt_tokens_computed"]
    right.axhline(0.1 * first, color="gray", lw=0.8, ls="--")
    right.annotate("10 % of request 1", (len(runs["b"]), 0.1 * first), textcoords="offset points", xytext=(0, 4),
                   ha="right", fontsize=8, color="gray")
    later = [r["prompt_tokens_computed"] for r in runs["b"][1:]]
    right.annotate(f"(b), (c): {min(later)}-{max(later)} tokens per request", (2.3, max(later)),
                   textcoords="offset points", xytext=(0, 22), fontsize=8, color="tab:blue")
    right.set_ylim(-40, 1.15 * max(r["prompt_tokens_computed"] for rows in runs.values() for r in rows))
    for ax in (left, right):
        ax.set_xticks(range(1, len(runs["b"]) + 1))
        ax.grid(alpha=0.3)
    handles, labels = right.get_legend_handles_labels()
    order = [labels.index(label[k]) for k in ["a", "b", "c", "c'", "d"]]
    right.legend([handles[i] for i in order], [labels[i] for i in order], loc="center right", fontsize=9)
    return _finish(fig, title, footnote)


def plot_policy_comparison(summaries: dict, title: str, footnote: str):
    """Chapter 04: throughput, then the median and the tail of TTFT, latency and TPOT, one colour per policy.
    The tail bar says "max" where there are too few samples for a P99 (``percentiles.tail``)."""
    fig, axes = plt.subplots(1, 4, figsize=(12, 3.2))
    colors = dict(zip(summaries, ["tab:gray", "tab:blue", "tab:green", "tab:orange"]))
    panels = [("output_throughput", "output tokens / s", "throughput (higher is better)"),
              ("ttft", "ms", "TTFT"), ("latency", "ms", "end-to-end latency"), ("tpot", "ms", "TPOT")]
    for ax, (key, unit, name) in zip(axes, panels):
        if key == "output_throughput":
            ax.bar(list(summaries), [s[key] for s in summaries.values()], color=list(colors.values()))
        else:
            for i, (policy, s) in enumerate(summaries.items()):
                label, top = tail(s, key)
                ax.bar([i - 0.2, i + 0.2], [s[f"p50_{key}_ms"], top], width=0.38, color=colors[policy],
                       edgecolor="black")
                ax.text(i - 0.2, 0, "P50", ha="center", va="bottom", fontsize=7, color="white")
                ax.text(i + 0.2, 0, label, ha="center", va="bottom", fontsize=7, color="white")
            ax.set_xticks(range(len(summaries)), list(summaries))
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    return _finish(fig, title, footnote)


def plot_rate_sweep(offered: list[float], summaries: list[dict], capacity: float, title: str, footnote: str):
    """Chapter 04: a Poisson rate sweep below and above the measured capacity, one point per rate.

    Left, requests/s served against offered, with the offered line and the capacity: below capacity the
    points follow the offered line, above it they flatten, which is what "capacity" means. Right, TTFT P50 and
    its tail (P99, or "max" for a rate with fewer than ``MIN_P99_SAMPLES`` requests, said in the legend), on a
    log scale: past capacity the queue, not the model, sets the first-token time."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    served = [s["request_throughput"] for s in summaries]
    top = max(offered + served) * 1.1
    left.plot([0, top], [0, top], ":", color="gray", label="served = offered")
    left.axhline(capacity, color="tab:red", lw=1, ls="--", label=f"capacity (all at once): {capacity:.2f} req/s")
    left.plot(offered, served, "o-", color="tab:blue", label="served")
    left.set(xlabel="offered rate (requests/s, Poisson)", ylabel="served (requests/s)", xlim=(0, top), ylim=(0, top),
             title="throughput")
    left.legend(fontsize=8)
    tails = [tail(s, "ttft") for s in summaries]
    right.plot(offered, [s["p50_ttft_ms"] for s in summaries], "o-", color="tab:blue", label="TTFT P50")
    right.plot(offered, [v for _, v in tails], "s--", color="tab:orange",
               label="TTFT " + "/".join(dict.fromkeys(label for label, _ in tails)))
    for x, s, (label, v) in zip(offered, summaries, tails):
        right.annotate(f"{label}, n={s['n_ttft']}", (x, v), textcoords="offset points", xytext=(4, 4), fontsize=7)
    right.axvline(capacity, color="tab:red", lw=1, ls="--")
    right.set(xlabel="offered rate (requests/s, Poisson)", ylabel="TTFT (ms, log scale)", yscale="log",
              title="time to first token")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return _finish(fig, title, footnote, bottom=0.06)
