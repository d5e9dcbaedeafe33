"""Pictures of the KV-cache budget: weights + cache against one GPU, and bytes per token by model.

The plain functions return a matplotlib figure (for notebooks and slides alike); the widget
wires them to sliders. Figures are closed in pyplot right after drawing, so a notebook shows
each exactly once (as the returned value) and redrawing the widget never piles figures up.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..kv_memory import (DTYPE_BYTES, GPUS, USABLE_FRACTION, GiB, KiB, MODELS, ModelFacts, kv_bytes,
                         kv_bytes_per_token, max_tokens_in_memory, mha_equivalent_bytes_per_token, weight_bytes)

GPU_DEFAULT = "80 GiB (A100 / H100)"
COLORS = {"MHA": "#d62728", "GQA": "#1f77b4", "MQA": "#2ca02c", "MLA": "#9467bd"}
WEIGHT_COLOR, KV_COLOR = "#7f7f7f", "#ff7f0e"
CONTEXTS = [512 * 2**i for i in range(9)]  # 512 .. 131072
BATCHES = [2**i for i in range(9)]  # 1 .. 256


def _gib(nbytes: float) -> str:
    """GPU memory in GiB: what nvidia-smi and torch.cuda report (a card sold as "80 GB" has 80 GiB)."""
    x = nbytes / GiB
    return f"{x:,.0f} GiB" if x >= 100 else f"{x:.1f} GiB" if x >= 1 else f"{x:.2f} GiB"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _resolve(model: ModelFacts | str, gpu: str | float) -> tuple[ModelFacts, str, float]:
    facts = MODELS[model] if isinstance(model, str) else model
    if isinstance(gpu, str):
        return facts, gpu, GPUS[gpu]
    return facts, _gib(gpu), float(gpu)


def budget_summary(model: ModelFacts | str, context_len: int, batch_size: int,
                   dtype: str = "bfloat16", gpu: str | float = GPU_DEFAULT) -> str:
    """One sentence: how many sequences of this length fit beside the weights, in the usable share."""
    facts, gpu_name, gpu_bytes = _resolve(model, gpu)
    w = weight_bytes(facts, dtype)
    if w > USABLE_FRACTION * gpu_bytes:
        return (f"the weights alone ({_gib(w)} in {dtype}) do not fit in {USABLE_FRACTION:g} of {gpu_name}: "
                f"no sequence fits")
    n = max_tokens_in_memory(facts, USABLE_FRACTION * gpu_bytes, dtype) // context_len
    return f"at this context, {n} concurrent sequences fit ({_tokens(context_len)} tokens each)"


def plot_kv_vs_weights(model: ModelFacts | str = "Llama-3-8B", context_len: int = 8192,
                       batch_size: int = 16, dtype: str = "bfloat16",
                       gpu: str | float = GPU_DEFAULT):
    """A horizontal stacked bar, weights then KV cache, against the GPU's memory and its usable share.

    Weights are counted in ``dtype`` too. Everything is in GiB, the unit nvidia-smi reports. An engine
    cannot plan for the whole card (CUDA context, activations, allocator slack), so the verdict is
    against ``USABLE_FRACTION`` of it, drawn as a dotted line. The title says which of the two is
    bigger (at long context and large batch it is the cache) and whether the total fits.
    """
    facts, gpu_name, gpu_bytes = _resolve(model, gpu)
    w = weight_bytes(facts, dtype)
    kv = kv_bytes(facts, context_len, batch_size, dtype)
    usable = USABLE_FRACTION * gpu_bytes
    fits = w + kv <= usable
    x_max = max(w + kv, gpu_bytes) * 1.12

    fig, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
    ax.barh(0, w / GiB, height=0.5, color=WEIGHT_COLOR, label=f"weights ({dtype})")
    ax.barh(0, kv / GiB, left=w / GiB, height=0.5, color=KV_COLOR, label=f"KV cache ({dtype})")
    for start, size, text in ((0, w, "weights"), (w, kv, "KV cache")):
        if size > 0.14 * x_max:  # label inside a segment only when the words fit in it
            ax.text((start + size / 2) / GiB, 0, f"{text}\n{_gib(size)}", ha="center",
                    va="center", color="white", fontsize=10, fontweight="bold")
    ax.axvline(gpu_bytes / GiB, color="black", linestyle="--", linewidth=1.5,
               label=f"GPU memory: {gpu_name}")
    ax.axvline(usable / GiB, color="black", linestyle=":", linewidth=1.5,
               label=f"usable: {USABLE_FRACTION:g} x {_gib(gpu_bytes)}")
    ax.axvspan(usable / GiB, x_max / GiB, color="#b00000", alpha=0.06, zorder=0)  # over budget
    ax.set_xlim(0, x_max / GiB)
    ax.set_ylim(-0.6, 0.9)
    ax.set_yticks([])
    ax.set_xlabel("memory (GiB, 2³⁰ bytes)")
    ax.legend(loc="upper right", ncols=2, fontsize=8, framealpha=1, edgecolor="none")
    sign = ">" if kv > w else "<" if kv < w else "="
    verdict = "fits" if fits else "does NOT fit"
    ax.set_title(f"KV cache {_gib(kv)} {sign} weights {_gib(w)}: total {_gib(w + kv)} {verdict} "
                 f"in {_gib(usable)} usable of {_gib(gpu_bytes)}\n"
                 f"{facts.name} ({facts.attention}), {batch_size} sequence{'s' * (batch_size != 1)} × "
                 f"{_tokens(context_len)} tokens, {dtype}",
                 fontsize=11, color="black" if fits else "#b00000")
    plt.close(fig)
    return fig


def plot_kv_per_token_comparison(dtype: str = "bfloat16", models: dict | None = None):
    """KiB of KV cache per token for every model, coloured by attention kind.

    A faint outline behind each bar is what full MHA would cache, so the gap is the saving.
    The y axis is logarithmic: MQA's 8 KiB and DeepSeek-V3's MHA-equivalent 4.8 MiB share one chart.
    """
    models = MODELS if models is None else models
    names = list(models)
    actual = [kv_bytes_per_token(models[n], dtype) / KiB for n in names]
    mha = [mha_equivalent_bytes_per_token(models[n], dtype) / KiB for n in names]
    kinds = [models[n].attention for n in names]

    fig, ax = plt.subplots(figsize=(10, 4.8), layout="constrained")
    xs = range(len(names))
    ax.bar(xs, mha, width=0.75, facecolor="none", edgecolor="#bbbbbb", linewidth=1.2, zorder=1)
    ax.bar(xs, actual, width=0.55, color=[COLORS[k] for k in kinds], zorder=2)
    for x, a, m in zip(xs, actual, mha):
        ax.text(x, a * 1.08, f"{a:,.1f}", ha="center", va="bottom", fontsize=8, zorder=3)
        if m > a * 1.5:
            ax.text(x, m * 1.08, f"÷{m / a:.0f}", ha="center", va="bottom", fontsize=8,
                    color="#777777")
    ax.set_yscale("log")
    ax.set_ylim(min(actual) / 2, max(mha) * 3)
    ax.set_xticks(list(xs), names, rotation=25, ha="right")
    ax.set_ylabel("KV cache per token (KiB, log scale)")
    handles = [Patch(color=COLORS[k], label=k) for k in COLORS if k in kinds]
    handles.append(Patch(facecolor="none", edgecolor="#bbbbbb", label="same model with full MHA"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, ncols=len(handles))
    ax.set_title(f"KV cache per token in {dtype} ({DTYPE_BYTES[dtype]} byte{'s' * (DTYPE_BYTES[dtype] > 1)} per number)\n"
                 "sharing K/V heads (GQA, MQA) or compressing them (MLA) divides the MHA cost",
                 fontsize=11)
    plt.close(fig)
    return fig


def kv_memory_widget(extra_models: list[ModelFacts] | tuple = (), model: str = "Llama-3-8B",
                     context_len: int = 8192, batch_size: int = 16, dtype: str = "bfloat16",
                     gpu: str = GPU_DEFAULT):
    """Sliders for model, context, batch, KV dtype and GPU over :func:`plot_kv_vs_weights`.

    ``extra_models`` (e.g. ``[kv_memory.from_config(llm.engine.model.config)]``) join the
    model list, so the chapter can put its own loaded model beside the big ones.
    """
    import ipywidgets as W
    from IPython import get_ipython
    from IPython.display import display

    models = dict(MODELS) | {f.name: f for f in extra_models}
    style = {"description_width": "110px"}
    model_w = W.Dropdown(options=list(models), value=model, description="model", style=style)
    ctx_w = W.SelectionSlider(options=[(_tokens(c), c) for c in CONTEXTS], value=context_len,
                              description="context (tokens)", continuous_update=False, style=style)
    batch_w = W.SelectionSlider(options=[(str(b), b) for b in BATCHES], value=batch_size,
                                description="batch (seqs)", continuous_update=False, style=style)
    dtype_w = W.Dropdown(options=list(DTYPE_BYTES), value=dtype, description="dtype",
                         style=style)
    gpu_w = W.Dropdown(options=list(GPUS), value=gpu, description="GPU", style=style)
    summary = W.Label()
    out = W.Output()
    box = W.VBox([model_w, ctx_w, batch_w, dtype_w, gpu_w, summary, out])

    def redraw(_=None):
        args = (models[model_w.value], ctx_w.value, batch_w.value, dtype_w.value, gpu_w.value)
        summary.value = budget_summary(*args)
        fig = plot_kv_vs_weights(*args)  # already closed in pyplot: shown once, then freed
        box.last_figure = fig
        if get_ipython() is not None:  # in plain Python there is nowhere to show it
            with out:
                out.clear_output(wait=True)
                display(fig)

    for w in (model_w, ctx_w, batch_w, dtype_w, gpu_w):
        w.observe(redraw, names="value")
    redraw()
    return box
