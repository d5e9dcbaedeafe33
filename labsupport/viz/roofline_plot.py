"""Chapter 09's roofline pictures, drawn from ``bench.lab.roofline_lab.roofline_report``'s dict.

``plot_roofline``: where each measured step sits (log-log: attainable FLOP/s against FLOPs per
byte), under this machine's two roofs and, for scale, the H200's. The vertical gap between a
point and the roof above it is the utilisation lost; the roof it sits under says which to read
(MBU left of the ridge, MFU right of it). ``plot_decode_scaling``: what batching buys in decode,
tokens/s and MBU/MFU against the batch size. Both return the figure, closed in pyplot so a
notebook shows it once.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

OURS, WHAT_IF, PREFILL, DECODE = "#222222", "#ff7f0e", "#d62728", "#1f77b4"


def _rate(flops: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP/s"


def _roof(ax, intensity, peak_flops, peak_bw, color, style, label):
    """One roof: the slanted bandwidth line up to the ridge, then the flat compute line."""
    ax.plot(intensity, np.minimum(peak_flops, peak_bw * intensity), style, color=color, lw=2, label=label)
    ridge = peak_flops / peak_bw
    ax.axvline(ridge, color=color, ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak_flops), textcoords="offset points", xytext=(4, 6),
                fontsize=8, color=color)


def plot_roofline(report: dict, what_if: bool = True, title: str | None = None, footnote: str | None = None):
    """Measured steps on this machine's roofline, and (``what_if``) the H200's roof with the same steps
    at its floor: the best they could do there, in its dtype (hollow markers)."""
    points, w = report["points"], report.get("what_if") if what_if else None
    xs = [p["intensity"] for p in points] + [report["ridge"]]
    if w:
        xs += [p["what_if"]["intensity"] for p in points if "what_if" in p] + [w["peak_flops"] / w["peak_bw"]]
    intensity = np.logspace(np.log10(min(xs) / 4), np.log10(max(xs) * 8), 200)

    fig, ax = plt.subplots(figsize=(9, 5.6), layout="constrained")
    _roof(ax, intensity, report["peak_flops"], report["peak_bw"], OURS, "-",
          f"this machine (measured): {_rate(report['peak_flops'])}, {report['peak_bw'] / 1e9:.3g} GB/s")
    if w:
        _roof(ax, intensity, w["peak_flops"], w["peak_bw"], WHAT_IF, "--",
              f"{w['name']}: {_rate(w['peak_flops'])}, {w['peak_bw'] / 1e12:.3g} TB/s")
    for i, p in enumerate(sorted(points, key=lambda p: p["intensity"])):
        color = PREFILL if p["kind"] == "prefill" else DECODE
        ax.plot([p["intensity"]] * 2, [p["achieved_flops"], p["attainable_flops"]], ":", color=color, lw=1)
        ax.plot(p["intensity"], p["achieved_flops"], "o", color=color, ms=7)
        util = p["mbu"] if p["bound"] == "memory" else p["mfu"]  # the one figure that matters under its roof
        ax.annotate(f"{p['label']}\n{util:.0%} {'MBU' if p['bound'] == 'memory' else 'MFU'}",
                    (p["intensity"], p["achieved_flops"]), textcoords="offset points", fontsize=7, color=color,
                    xytext=(5, -20 if i % 2 else 6), ha="left")  # alternate below/above: neighbours are close
        if w and "what_if" in p:
            x = p["what_if"]
            ax.plot(x["intensity"], x["attainable_flops"], "o", mfc="none", color=color, ms=7)
    ax.plot([], [], "o", color=PREFILL, label="prefill (measured)")
    ax.plot([], [], "o", color=DECODE, label="decode at batch B (measured)")
    if w:
        ax.plot([], [], "o", mfc="none", color="gray", label=f"the same steps at the {w['name'].split()[0]} floor")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte moved)",
           ylabel="FLOP/s (attainable on the roofs, achieved at the points)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or "Left of the ridge a step waits on memory (read MBU), right of it on compute (read MFU)",
                 fontsize=11)
    if footnote:
        fig.text(0.01, 0.005, footnote, fontsize=8, color="gray")
    plt.close(fig)
    return fig


def plot_decode_scaling(report: dict, title: str | None = None, footnote: str | None = None):
    """Decode tokens/s (measured, and the roof's ceiling ``B / floor``) and MBU/MFU against the batch.

    While decode is memory-bound every extra sequence rides on the same weight read: tokens/s
    climbs almost linearly with B and MBU holds. Past the ridge (the shaded side) compute takes
    over: step time grows with B, tokens/s flattens, and MFU becomes the figure to watch."""
    decode = report["decode"]
    if not decode:
        raise ValueError("the report has no decode points")
    batches = [p["batch"] for p in decode]
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    ax.plot(batches, [p["tokens_per_s"] for p in decode], "o-", color=DECODE, lw=2, label="tokens/s (measured)")
    ax.plot(batches, [p["batch"] / p["floor_seconds"] for p in decode], "--", color=OURS, lw=1.5,
            label="tokens/s ceiling of this machine's roofs")
    ax.set(xscale="log", yscale="log", xlabel="decode batch size B (sequences per step)", ylabel="decode tokens/s")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    cb = report.get("compute_bound_batch_measured")
    ax.set_ylim(top=ax.get_ylim()[1] * 2.5)  # headroom for the note below
    if cb:
        ax.axvspan(cb, max(batches) * 1.3, color="#b00000", alpha=0.06, zorder=0)
        ax.annotate(f"compute-bound from B={cb}", (cb, ax.get_ylim()[1]), textcoords="offset points", xytext=(4, -12),
                    fontsize=8, color="#b00000")
    util = ax.twinx()
    util.plot(batches, [100 * p["mbu"] for p in decode], "s-", color="tab:green", label="MBU (right axis)")
    util.plot(batches, [100 * p["mfu"] for p in decode], "^-", color="tab:purple", label="MFU (right axis)")
    util.set_ylabel("utilisation of this machine's roofs (%)")
    util.set_ylim(0, max(100, 110 * max(max(p["mbu"], p["mfu"]) for p in decode)))
    lines = ax.get_legend_handles_labels()
    more = util.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=4,
              fontsize=8)
    ax.set_title(title or "Decode: batching amortises the weight read until compute takes over", fontsize=11)
    if footnote:
        fig.text(0.01, 0.005, footnote, fontsize=8, color="gray")
    plt.close(fig)
    return fig
