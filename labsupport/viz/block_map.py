"""A live picture of a paged KV pool: one small square per block, coloured by the request using it.

PagedAttention's whole argument is visual: memory is cut into fixed-size blocks, requests take
only the blocks they need, prefixes are shared by reference counting, and the waste left is at
most one partly filled block per request. ``BlockMap`` shows exactly that while the engine runs.

A *snapshot* is a plain dict, so the view does not depend on the allocator's internals::

    {"block_size": 16,
     "owners": [["req-0"], [], ["req-0", "req-1"], ...],  # request ids per block; [] = free
     "ref_counts": [1, 0, 2, ...],
     "cached": [False, True, False, ...],                  # optional: free but holds reusable KV
     "tokens": [16, 0, 9, ...]}                            # optional: slots filled, 0..block_size

``render_html(snapshot)`` returns the HTML (testable without a kernel); ``BlockMap`` puts it in
an ``ipywidgets.HTML`` and re-renders on ``update(snapshot)`` / ``refresh()``.
"""
import re
from html import escape

# A fixed qualitative palette (matplotlib's tab10 without its grey, which would read as "free",
# plus a dark indigo), so colours match the course's matplotlib figures.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79"]
FREE = "#e4e4e4"
ORPHAN = "#555555"  # held by nobody: a leaked block
CACHED = f"radial-gradient(#777 0.8px, transparent 1.2px) 0 0 / 4px 4px, {FREE}"

# One stylesheet per map instead of per-block inline styles keeps a 2,000-block map small.
CSS = """<style>
.kv-block-map {font: 12px/1.4 system-ui, sans-serif; color: #222}
.kv-block-map .kv-title {font-weight: 600; font-size: 13px}
.kv-block-map .kv-legend span {display: inline-block; margin: 2px 10px 2px 0; white-space: nowrap}
.kv-block-map .kv-legend i {display: inline-block; width: 11px; height: 11px; margin-right: 4px;
  vertical-align: -1px; border-radius: 2px; box-sizing: border-box}
.kv-block-map .kv-grid {display: grid; gap: 2px; margin-top: 6px}
.kv-block-map .kv-row-label {font-size: 9px; color: #888; padding-right: 4px;
  display: flex; align-items: center; justify-content: flex-end}
.kv-block-map .kv-block {position: relative; box-sizing: border-box; border-radius: 2px;
  overflow: hidden; font: bold 9px/1 sans-serif; color: #fff; text-align: center;
  display: flex; align-items: center; justify-content: center; text-shadow: 0 0 2px #000}
.kv-block-map .kv-free {background: %(free)s}
.kv-block-map .kv-shared {border: 2px solid #111}
.kv-block-map .kv-cached {border: 1px dashed #666; background: %(cached)s}
.kv-block-map .kv-empty {position: absolute; inset: 0 0 auto 0; background: #fff; opacity: .6}
.kv-block-map .kv-block span {position: relative}
</style>""" % {"free": FREE, "cached": CACHED}


def assign_colors(request_ids, colors: dict) -> dict:
    """Give each new request id a palette colour, kept for as long as ``colors`` lives.

    A new id takes the first colour no request on screen is using, so up to ``len(PALETTE)``
    live requests never share a colour, and a request keeps its colour across updates.
    """
    live = {colors[r] for r in request_ids if r in colors}
    for rid in request_ids:
        if rid not in colors:
            free = [c for c in PALETTE if c not in live]
            colors[rid] = free[0] if free else PALETTE[len(colors) % len(PALETTE)]
            live.add(colors[rid])
    return colors


def summarize(snapshot) -> dict:
    """Counts for the summary line: blocks used, requests, shared, cached, held by no request, wasted slots.

    A block with a reference but no owner (held for a KV transfer, or leaked) is counted apart: its
    empty slots are not internal fragmentation, which is the tail of a live request's last block."""
    owners, refs = snapshot["owners"], _ref_counts(snapshot)
    tokens = snapshot.get("tokens")
    used = [b for b in range(len(owners)) if refs[b] > 0]
    return {
        "blocks": len(owners),
        "used": len(used),
        "requests": len({r for o in owners for r in o}),
        "shared": sum(1 for b in used if refs[b] > 1),
        "cached": sum(1 for b, c in enumerate(snapshot.get("cached") or []) if c and refs[b] == 0),
        "unowned": sum(1 for b in used if not owners[b]),
        # internal fragmentation: reserved but unfilled slots of requests' blocks, the only waste paging leaves
        "fragmentation": None if tokens is None
        else sum(snapshot["block_size"] - tokens[b] for b in used if owners[b]),
    }


def render_html(snapshot, title="KV block pool", colors=None, columns=32, cell=14) -> str:
    """The block map as one HTML string: title, summary line, legend, then the grid.

    Every square is ``<div class="kv-block ..." data-block="i" title="...">``: ``kv-used`` or
    ``kv-free``, plus ``kv-shared`` (ref count > 1, thick border, count shown) or
    ``kv-cached`` (free but holding reusable KV, dotted). A white veil over the top of a used
    square hides the unfilled fraction, so partly filled blocks show how full they are.
    """
    owners, refs = snapshot["owners"], _ref_counts(snapshot)
    cached = snapshot.get("cached") or [False] * len(owners)
    tokens = snapshot.get("tokens") or [None] * len(owners)
    size = snapshot["block_size"]
    if not len(owners) == len(refs) == len(cached) == len(tokens):
        raise ValueError("owners, ref_counts, cached and tokens must have one entry per block")
    ids = sorted({r for o in owners for r in o}, key=_natural)  # req-2 before req-10
    colors = assign_colors(ids, {} if colors is None else colors)
    cells = []
    for b, block in enumerate(zip(owners, refs, cached, tokens)):
        if b % columns == 0:
            cells.append(f'<div class="kv-row-label">{b}</div>')
        cells.append(_square(b, *block, size, colors))

    s = summarize(snapshot)
    plural = "" if s["requests"] == 1 else "s"
    parts = [f"{s['used']}/{s['blocks']} blocks used", f"{s['requests']} request{plural}",
             f"{s['shared']} shared"]
    if snapshot.get("cached") is not None:
        parts.append(f"{s['cached']} cached")
    if s["unowned"]:
        parts.append(f"{s['unowned']} held by no request")
    if s["fragmentation"] is not None:
        parts.append(f"internal fragmentation {s['fragmentation']} slots")
    legend = [f'<span><i style="background: {colors[r]}"></i>{escape(str(r))}</span>' for r in ids]
    legend += [f'<span><i style="background: {FREE}"></i>free</span>',
               '<span><i style="border: 2px solid #111"></i>shared (ref count)</span>']
    if snapshot.get("cached") is not None:
        legend.append(f'<span><i style="border: 1px dashed #666; background: {CACHED}"></i>'
                      'cached, reusable</span>')
    grid = f"grid-template-columns: 28px repeat({columns}, {cell}px); grid-auto-rows: {cell}px"
    return (f'<div class="kv-block-map">{CSS}'
            f'<div class="kv-title">{escape(title)} · block size {size}</div>'
            f'<div class="kv-summary">{" · ".join(parts)}</div>'
            f'<div class="kv-legend">{"".join(legend)}</div>'
            f'<div class="kv-grid" style="{grid}">{"".join(cells)}</div></div>')


def _square(b, who, n, cached, filled, size, colors):
    """One block: its state classes, owner colour(s), ref count, fill veil and tooltip."""
    tip = [f"block {b}", "owners: " + ", ".join(map(str, who)), f"ref count {n}"]
    if filled is not None:
        tip.append(f"{filled}/{size} tokens filled")
    style = inner = ""
    if n == 0:
        kind = "kv-free kv-cached" if cached else "kv-free"
        tip[1] = "cached KV, reusable" if cached else "free"
    else:
        kind = "kv-used kv-shared" if n > 1 else "kv-used"
        style = f' style="background: {_fill(who, colors)}"'
        inner = f"<span>{n}</span>" if n > 1 else ""
        if filled is not None and filled < size:
            empty = 100 * (size - filled) / size
            inner = f'<div class="kv-empty" style="height: {empty:.0f}%"></div>' + inner
    return (f'<div class="kv-block {kind}" data-block="{b}"{style} '
            f'title="{escape(" · ".join(tip))}">{inner}</div>')


def _natural(request_id):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(request_id))]


def _ref_counts(snapshot):
    refs = snapshot.get("ref_counts")
    return refs if refs is not None else [len(o) for o in snapshot["owners"]]


def _fill(owners, colors):
    """One owner: its colour. Shared: diagonal stripes of every owner's colour."""
    cs = [colors[r] for r in owners] or ["#555"]
    if len(cs) == 1:
        return cs[0]
    stripes = ", ".join(f"{c} {i * 3}px {(i + 1) * 3}px" for i, c in enumerate(cs))
    return f"repeating-linear-gradient(45deg, {stripes})"


class BlockMap:
    """An ipywidgets view of a paged KV pool; display it, then ``update`` or ``refresh`` it.

    ``snapshot_fn`` (optional) returns the current snapshot; with it, ``refresh()`` and the
    Refresh button re-read the pool. Colours are remembered per instance, so a request keeps
    its colour for the whole life of the map.
    """

    def __init__(self, snapshot_fn=None, title="KV block pool", columns=32):
        import ipywidgets as widgets  # a course extra: render_html works without it

        self.snapshot_fn, self.title, self.columns = snapshot_fn, title, columns
        self.colors, self.snapshot = {}, None
        self.html = widgets.HTML(value=f"<i>{escape(title)}: no snapshot yet</i>")
        children = [self.html]
        if snapshot_fn is not None:
            button = widgets.Button(description="Refresh", icon="refresh")
            button.on_click(lambda _: self.refresh())
            children.insert(0, button)
            self.refresh()
        self.widget = widgets.VBox(children)

    def update(self, snapshot):
        """Re-render from ``snapshot`` (the widget updates in place in the notebook)."""
        self.snapshot = snapshot
        self.html.value = render_html(snapshot, self.title, self.colors, self.columns)

    def refresh(self):
        """Read a fresh snapshot from ``snapshot_fn`` and show it."""
        if self.snapshot_fn is None:
            raise ValueError("BlockMap was created without a snapshot_fn; call update(snapshot)")
        self.update(self.snapshot_fn())

    def _repr_mimebundle_(self, **kwargs):
        # leaving ``BlockMap(...)`` as a cell's last expression displays the widget
        return self.widget._repr_mimebundle_(**kwargs)


def plot_block_map(snapshot, title="KV block pool", columns=32, ax=None, colors=None):
    """The same picture as a static matplotlib figure (for decks and saved notebooks): one square
    per block in the owner's colour, a thick black edge and the ref count on shared blocks, dotted
    grey for cached free blocks, the unfilled top of a partly filled block left pale, and dark grey for
    a block that is held (ref count > 0) by no request: a leak, which a live engine should never show."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    owners, refs = snapshot["owners"], _ref_counts(snapshot)
    cached = snapshot.get("cached") or [False] * len(owners)
    tokens = snapshot.get("tokens") or [None] * len(owners)
    size = snapshot["block_size"]
    ids = sorted({r for o in owners for r in o}, key=_natural)
    colors = assign_colors(ids, {} if colors is None else colors)
    rows = -(-len(owners) // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 0.32 * columns + 1), 0.32 * rows + 1.6))
    for b, (who, n, hit, filled) in enumerate(zip(owners, refs, cached, tokens)):
        x, y = b % columns, -(b // columns)
        color = colors[who[0]] if n and who else (ORPHAN if n else FREE)
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=color, hatch="...." if hit and not n else None,
                               edgecolor="black" if n > 1 else ("#666" if hit and not n else "none"),
                               linewidth=2 if n > 1 else 0.8, linestyle="--" if hit and not n else "-"))
        if n and who and filled is not None and filled < size:  # the unfilled part of the block, veiled
            ax.add_patch(Rectangle((x, y + 0.9 * filled / size), 0.9, 0.9 * (size - filled) / size,
                                   facecolor="white", alpha=0.6, edgecolor="none"))
        if n > 1:
            ax.text(x + 0.45, y + 0.45, str(n), ha="center", va="center", fontsize=7, color="white",
                    fontweight="bold")
    ax.set_xlim(-0.2, columns)
    ax.set_ylim(-rows + 0.8, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    s = summarize(snapshot)
    extra = [f"{s['cached']} cached"] if snapshot.get("cached") is not None else []
    if s["unowned"]:
        extra.append(f"{s['unowned']} held by no request")
    if s["fragmentation"] is not None:
        extra.append(f"internal fragmentation {s['fragmentation']} slots")
    ax.set_title(f"{title} · block size {size}\n" + " · ".join(
        [f"{s['used']}/{s['blocks']} blocks used", f"{s['requests']} requests", f"{s['shared']} shared"] + extra),
        fontsize=10, loc="left")
    handles = [Patch(facecolor=colors[r], label=str(r)) for r in ids] + [
        Patch(facecolor=FREE, label="free"), Patch(facecolor="white", edgecolor="black", linewidth=2,
                                                   label="shared (ref count)")]
    if snapshot.get("cached") is not None:
        handles.append(Patch(facecolor=FREE, hatch="....", edgecolor="#666", linestyle="--", label="cached, reusable"))
    if any(n and not who for who, n in zip(owners, refs)):
        handles.append(Patch(facecolor=ORPHAN, label="held, no request owns it"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncols=min(6, len(handles)), fontsize=7,
              frameon=False)
    return ax.figure
