"""Pictures of speculative decoding: how many tokens a verified step yields, and what that buys.

Drawn from ``labsupport.bench.lab.spec_bench.run``'s report: acceptance length and speed-up against the
number of guesses k, one line per traffic and temperature (one user at a time), and speed-up against
the batch size, where a verify step stops being almost free. Figures are closed in pyplot after
drawing, so a notebook shows each once.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

COLORS = {"repetitive": "#1f77b4", "open-ended": "#ff7f0e"}  # colour: the traffic
DASHES = {0.0: "-", 1.0: "--"}  # line style: the temperature


def _legend(ax, workloads, temperatures):
    """One legend entry per traffic (its colour) and one per temperature (its line style, drawn long and
    without a marker, so the dashes show): lines with markers hide a dash in a legend's short sample."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=COLORS.get(w, "grey"), marker="o", lw=2) for w in workloads]
    handles += [Line2D([], [], color="black", ls=DASHES.get(t, ":"), lw=1.5) for t in temperatures]
    labels = list(workloads) + [f"T={t:g}" + (" (greedy)" if t == 0 else "") for t in temperatures]
    return ax.legend(handles, labels, fontsize=8, handlelength=3.5)


def plot_spec(report: dict, title: str | None = None):
    rows = [r for r in report["rows"] if not r.get("repeat")]  # plain decoding's second run only measures noise
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    k_rows = [r for r in rows if r["sweep"] == "k"]
    for (workload, temp) in sorted({(r["workload"], r["temperature"]) for r in k_rows}):
        line = sorted((r for r in k_rows if r["workload"] == workload and r["temperature"] == temp),
                      key=lambda r: r["k"])
        color, dash = COLORS.get(workload), DASHES.get(temp, ":")
        label = f"{workload}, T={temp:g}"
        axes[0].plot([r["k"] for r in line], [r.get("acceptance_length", 1.0) for r in line], dash, marker="o",
                     color=color, label=label)
        axes[1].plot([r["k"] for r in line], [r["speedup"] for r in line], dash, marker="o", color=color, label=label)
    axes[0].set(xlabel="guesses per step (k)", ylabel="tokens per verified step", title="acceptance length (1 user)")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(xlabel="guesses per step (k)", ylabel="x plain decoding", title="speed-up (1 user)")
    _legend(axes[0], sorted({r["workload"] for r in k_rows}), sorted({r["temperature"] for r in k_rows}))
    batch = sorted((r for r in rows if r["sweep"] == "batch" and r["k"] > 0), key=lambda r: r["batch"])
    single = [r for r in k_rows if r["workload"] == "repetitive" and r["temperature"] == 0.0 and r["k"] > 0]
    k = batch[0]["k"] if batch else None
    points = [r for r in single if r["k"] == k] + batch
    if points:
        axes[2].plot([r["batch"] for r in points], [r["speedup"] for r in points], marker="o", color="#1f77b4")
        for r in points:
            axes[2].annotate(f"{r.get('acceptance_length', 1):.1f} tok/step", (r["batch"], r["speedup"]),
                             textcoords="offset points", xytext=(4, 6), fontsize=8)
        axes[2].set_xscale("log", base=2)
        axes[2].margins(x=0.15, y=0.2)  # room for the labels: none runs into the title or past the right edge
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set(xlabel="concurrent requests", ylabel="x plain decoding",
                title=f"speed-up against batch (repetitive, greedy, k={k})")
    fig.suptitle(title or f"speculative decoding ({report['method']}), {report['max_tokens']} tokens per request")
    fig.tight_layout()
    plt.close(fig)
    return fig
