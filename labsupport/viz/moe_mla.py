"""Pictures for "compute less": KV cache by attention kind, experts a batch touches, hot-expert imbalance.

Every number comes from :mod:`labsupport.model_arithmetic` (real published configs), whose KV-cache
and weight bytes are chapter 01's (:mod:`labsupport.kv_memory`, through ``to_facts``); dtypes are
named as there ("bfloat16", "fp8") and the colours are chapter 01's. The plain functions return a
matplotlib figure, closed in pyplot so a notebook shows it once; ``explore_moe`` wires a compact
version of all three to sliders, with a small table of the numbers behind them.
"""
from __future__ import annotations

import html

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from .. import kv_memory as kvm
from .. import model_arithmetic as ma
from .kv_charts import COLORS

BATCHES = [2**i for i in range(11)]  # 1 .. 1024
DEVICES = [1, 2, 4, 8, 16, 32, 64]
CONTEXTS = [1024 * 2**i for i in range(8)]  # 1K .. 128K
HBM_BYTES_PER_S = 4.8e12  # H200 memory bandwidth, as quoted by NVIDIA


def _spec(model) -> ma.ModelSpec:
    return ma.MODELS[model] if isinstance(model, str) else model


def _layouts(cfg: ma.ModelSpec) -> list[str]:
    """The attention layouts worth comparing for this model: MHA, GQA, and MLA if it has a latent."""
    return ["MHA", "GQA"] + (["MLA"] if cfg.kv_lora_rank else [])


def _layout_label(cfg: ma.ModelSpec, layout: str) -> str:
    if layout == "GQA":
        return f"GQA ({ma.to_facts(cfg, 'GQA').kv_heads} KV heads)"
    return "MLA (latent)" if layout == "MLA" else f"MHA ({cfg.num_attention_heads} heads)"


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K" if n >= 1e3 else f"{n:.0f}"


def _draw_concurrency(ax, cfg, dtype, num_gpus, context_len, weight_dtype=None):
    """Bars of max concurrent tokens for each attention layout of ``cfg`` on ``num_gpus`` H200s."""
    layouts, wd = _layouts(cfg), weight_dtype or dtype
    tokens = [ma.max_concurrent_tokens(cfg, num_gpus=num_gpus, dtype=dtype, weight_dtype=wd, layout=lay)
              for lay in layouts]
    fitting = [t for t in tokens if t] or [10]
    bottom = max(1, min(fitting) / 30)  # a layout whose weights do not fit gets no bar, only a note
    bars = ax.bar(range(len(layouts)), [t or bottom for t in tokens], color=[COLORS[lay] for lay in layouts])
    ax.bar_label(bars, [f"{_count(t)} tok\n{t // context_len:,} seqs" if t else "weights\ndo not fit"
                        for t in tokens], fontsize=7)
    ax.set(yscale="log", ylim=(bottom, max(fitting) * 30), ylabel="tokens of KV cache that fit (log)")
    ax.set_xticks(range(len(layouts)), [_layout_label(cfg, lay) for lay in layouts], fontsize=7)
    ax.set_title(f"{cfg.name} on {num_gpus}×H200 (weights {wd}, KV cache {dtype}):\n"
                 f"tokens that fit, and sequences of {context_len // 1024}K", fontsize=9)


def plot_kv_by_attention(model: ma.ModelSpec | str = "DeepSeek-V3", dtype: str = "bfloat16", num_gpus: int = 8,
                         weight_dtype: str = "fp8", context_len: int = 32768):
    """Left: KV KiB per token for every model, by attention kind, with DeepSeek-V3's MHA equivalent.
    Right: what that means for ``model``: how many tokens fit beside its weights with each layout."""
    cfg = _spec(model)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained",
                                      gridspec_kw={"width_ratios": [3, 2]})
    names = list(ma.MODELS)
    facts = [ma.to_facts(n) for n in names]
    kib = [kvm.kv_bytes_per_token(f, dtype) / kvm.KiB for f in facts]
    mha = [kvm.mha_equivalent_bytes_per_token(f, dtype) / kvm.KiB for f in facts]
    xs = range(len(names))
    left.bar(xs, mha, width=0.75, facecolor="none", edgecolor="#bbbbbb")
    bars = left.bar(xs, kib, width=0.55, color=[COLORS[ma.MODELS[n].attention] for n in names])
    left.bar_label(bars, [f"{k:,.0f}" for k in kib], fontsize=8)
    for x, k, m in zip(xs, kib, mha):
        if m > 1.5 * k:
            left.text(x, m * 1.1, f"÷{m / k:.0f}", ha="center", fontsize=8, color="#777777")
    left.set(yscale="log", ylim=(min(kib) / 2, max(mha) * 4), ylabel=f"KV cache per token, KiB ({dtype}, log)")
    left.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    handles = [Patch(color=COLORS[k], label=k) for k in ("MHA", "GQA", "MLA")]
    handles.append(Patch(facecolor="none", edgecolor="#bbbbbb", label="same model with MHA"))
    left.legend(handles=handles, fontsize=8, ncols=4, loc="upper left")
    ds = ma.MODELS["DeepSeek-V3"]
    left.set_title(f"DeepSeek-V3's MLA caches {ds.kv_lora_rank} + {ds.qk_rope_head_dim} = "
                   f"{ma.kv_values_per_token_per_layer(ds)} numbers per token and layer;\nMHA with its "
                   f"{ds.num_attention_heads} heads would cache {ma.kv_values_per_token_per_layer(ds, 'MHA'):,}",
                   fontsize=9)
    _draw_concurrency(right, cfg, dtype, num_gpus, context_len, weight_dtype)
    plt.close(fig)
    return fig


def _draw_weight_reads(ax, cfg, dtype, batch=None):
    """Weight GB read per decode step vs batch, between the active and the total count."""
    reads = [ma.weight_bytes_read_per_step(cfg, b, dtype) / 1e9 for b in BATCHES]
    total, active = (p * kvm.DTYPE_BYTES[dtype] / 1e9 for p in ma.total_and_active_params(cfg))
    ax.plot(BATCHES, reads, "o-", color="#ff7f0e", ms=3, label="read per step (input embedding: a lookup, not read)")
    ax.axhline(total, color="black", ls="--", lw=1, label=f"all weights {total:,.0f} GB")
    ax.axhline(active, color="gray", ls=":", lw=1, label=f"active per token {active:,.0f} GB")
    if batch:
        ax.axvline(batch, color="#9467bd", lw=1)
    ax.set(xscale="log", xlabel="batch (tokens per decode step, log)", ylabel="GB of weights read per step",
           ylim=(0, total * 1.1))
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"{cfg.name}: weights one step streams ({dtype})", fontsize=9)


def plot_experts_touched(model: ma.ModelSpec | str = "DeepSeek-V3", dtype: str = "fp8", batch: int | None = None):
    """Left: share of experts a batch touches per layer, every MoE model. Right: the weights that
    costs ``model`` per decode step: near the active count at batch 1, near everything by batch ~E/k x 4."""
    cfg = _spec(model)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    for c in (m for m in ma.MODELS.values() if m.n_routed_experts):
        e, k = c.n_routed_experts, c.num_experts_per_tok
        left.plot(BATCHES, [ma.experts_touched(e, k, b) / e for b in BATCHES], "o-", ms=3,
                  label=f"{c.name} (top-{k} of {e})")
    left.set(xscale="log", ylim=(0, 1.05), xlabel="batch (tokens per decode step, log)",
             ylabel="share of experts touched per layer")
    left.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    left.legend(fontsize=8)
    left.set_title("E·(1 − (1 − k/E)^B): uniform routing, one layer", fontsize=9)
    _draw_weight_reads(right, cfg, dtype, batch)
    plt.close(fig)
    return fig


def plot_imbalance_vs_skew(num_experts: int = 256, top_k: int = 8, device_counts=(8, 32, 64),
                           skews=tuple(np.linspace(0, 1.5, 7)), tokens: int = 8192, seed: int = 0):
    """Max/mean device load against Zipf skew, one line per device count (fewer experts per device)."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    expert_loads = [ma.sample_expert_loads(num_experts, top_k, s, tokens, seed) for s in skews]  # one draw per skew
    for d in device_counts:
        ratios = [ma.max_over_mean(ma.device_loads(e, d)) for e in expert_loads]
        ax.plot(skews, ratios, "o-", ms=4, label=f"{d} devices ({num_experts // d} experts each)")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set(xlabel="routing skew s (expert popularity ∝ 1/rank^s)", ylabel="max / mean device load",
           yscale="log")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.legend(fontsize=8)
    ax.set_title(f"Hot experts: the busiest device sets the step time\n{num_experts} experts, top-{top_k}, "
                 f"{tokens:,} tokens, seed {seed}", fontsize=10)
    plt.close(fig)
    return fig


def moe_numbers(model, batch: int, skew: float, devices: int, context_len: int, dtype: str) -> list[tuple[str, str]]:
    """(label, value) rows behind the explorer: parameters, KV, FLOPs, weight reads, all-to-all, imbalance."""
    cfg = _spec(model)
    total, active = ma.total_and_active_params(cfg)
    kv = kvm.kv_bytes_per_token(ma.to_facts(cfg), dtype)
    fits = ma.max_concurrent_tokens(cfg, num_gpus=devices, dtype=dtype)
    reads = ma.weight_bytes_read_per_step(cfg, batch, dtype)
    flops = ma.decode_flops_per_token(cfg, context_len)
    rows = [("parameters: total / active per token", f"{total / 1e9:,.1f}B / {active / 1e9:,.2f}B"),
            (f"KV cache per token ({dtype}, {cfg.attention})",
             f"{kv / kvm.KiB:,.1f} KiB ({ma.kv_values_per_token_per_layer(cfg)} numbers × "
             f"{cfg.num_hidden_layers} layers)"),
            (f"tokens that fit on {devices}×H200", f"{_count(fits)} ({fits // context_len:,} seqs of {context_len:,})"
             if fits else "weights do not fit"),
            (f"decode GFLOP per token at context {context_len:,}", f"{flops / 1e9:,.1f}"),
            (f"weights read per step at batch {batch}",
             f"{reads / 1e9:,.1f} GB = {reads / devices / HBM_BYTES_PER_S * 1e3:.2f} ms per device at 4.8 TB/s"),
            ("FLOPs per weight byte read (arithmetic intensity)", f"{batch * flops / reads:,.0f}")]
    if cfg.n_routed_experts:
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        ep = min(devices, e)
        a2a = ma.all_to_all_bytes(cfg, batch, dtype, "bfloat16")  # combine stays bf16 whatever dispatch uses
        secs = {link.split(" (")[0]: ma.all_to_all_seconds(cfg, batch, ep, bw, dtype, "bfloat16")
                for link, bw in ma.LINKS.items()}
        times = ", ".join(f"{link} {t * 1e3:.2f} ms" for link, t in secs.items())
        step = ma.expert_load_imbalance(e, ep, k, skew, batch, seed=0)
        long_run = ma.expert_load_imbalance(e, ep, k, skew, 8192, seed=0)
        rows += [(f"experts touched per layer at batch {batch}", f"{ma.experts_touched(e, k, batch):.1f} of {e}"),
                 (f"all-to-all per step (dispatch {dtype}, combine bfloat16)", f"{a2a / 1e6:,.1f} MB over "
                  f"{cfg.moe_layers} MoE layers; on {ep} devices: {times}"),
                 (f"max/mean device load, skew {skew:g}, {ep} devices",
                  f"{step:.2f}× this step, {long_run:.2f}× over 8,192 tokens")]
    return rows


def _table_html(rows) -> str:
    body = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td><td style='text-align:left'>"
                   f"{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table style='font-size:12px'>{body}</table>"


def plot_moe_overview(model="DeepSeek-V3", batch: int = 64, skew: float = 0.8, devices: int = 8,
                      context_len: int = 4096, dtype: str = "fp8"):
    """The explorer's compact figure: weights read vs batch, tokens that fit per layout, device loads."""
    cfg = _spec(model)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), layout="constrained")
    _draw_weight_reads(axes[0], cfg, dtype, batch)
    _draw_concurrency(axes[1], cfg, dtype, devices, context_len)
    ax = axes[2]
    if cfg.n_routed_experts:
        e, ep = cfg.n_routed_experts, min(devices, cfg.n_routed_experts)
        loads = ma.device_loads(ma.sample_expert_loads(e, cfg.num_experts_per_tok, skew, 8192, seed=0), ep)
        ax.bar(range(ep), loads / loads.mean(), color=["#d62728" if x == loads.max() else "#1f77b4" for x in loads])
        ax.axhline(1, color="black", lw=0.8)
        ax.set(xlabel=f"device ({e // ep} experts each)", ylabel="load / mean")
        ax.set_title(f"Zipf skew {skew:g}: busiest device {loads.max() / loads.mean():.2f}× the mean", fontsize=9)
    else:
        ax.text(0.5, 0.5, f"{cfg.name} is dense:\nno experts to balance", ha="center", va="center")
        ax.set_axis_off()
    plt.close(fig)
    return fig


def explore_moe(model: str = "DeepSeek-V3", batch: int = 64, skew: float = 0.8, devices: int = 8,
                context_len: int = 4096, dtype: str = "fp8"):
    """Dropdown model, sliders batch / skew / devices / context / dtype over :func:`plot_moe_overview`
    and :func:`moe_numbers`. Returns the widget box (its ``last_figure`` is the latest figure)."""
    import ipywidgets as W
    from IPython import get_ipython
    from IPython.display import display

    style = {"description_width": "110px"}
    model_w = W.Dropdown(options=list(ma.MODELS), value=model, description="model", style=style)
    batch_w = W.SelectionSlider(options=BATCHES, value=batch, description="batch (tokens)",
                                continuous_update=False, style=style)
    skew_w = W.FloatSlider(value=skew, min=0, max=2, step=0.1, description="routing skew",
                           continuous_update=False, style=style)
    dev_w = W.SelectionSlider(options=DEVICES, value=devices, description="GPUs (H200)",
                              continuous_update=False, style=style)
    ctx_w = W.SelectionSlider(options=[(f"{c // 1024}K", c) for c in CONTEXTS], value=context_len,
                              description="context", continuous_update=False, style=style)
    dtype_w = W.ToggleButtons(options=[("bf16", "bfloat16"), ("fp8", "fp8")], value=dtype, description="dtype",
                              style=style)
    table, out = W.HTML(), W.Output()
    controls = [model_w, batch_w, skew_w, dev_w, ctx_w, dtype_w]
    box = W.VBox([W.HBox([W.VBox(controls[:3]), W.VBox(controls[3:])]), table, out])

    def redraw(_=None):
        args = (model_w.value, batch_w.value, skew_w.value, dev_w.value, ctx_w.value, dtype_w.value)
        table.value = _table_html(moe_numbers(*args))
        box.last_figure = fig = plot_moe_overview(*args)
        if get_ipython() is not None:  # in plain Python there is nowhere to show it
            with out:
                out.clear_output(wait=True)
                display(fig)

    for w in controls:
        w.observe(redraw, names="value")
    redraw()
    return box
