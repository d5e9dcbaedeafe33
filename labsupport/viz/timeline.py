"""A live batch timeline: slots down, engine steps across, each cell coloured by the request in it.

Continuous batching is a picture before it is a number: with static batches a slot stays empty
from the moment its short request ends until the longest one in the batch finishes; with
continuous batching the next request takes the slot at the next step. ``BatchTimeline`` draws
what the engine actually did, from its own step records (``engine.last_step``), so it is fed by
``run_workload(..., on_step=timeline.on_step)`` or by calling ``timeline.record(step)``.

A request keeps its slot (a row) from admission until it finishes or is preempted; then the
lowest free slot goes to the next one. Cells are *prefill* (hatched: a prompt, a chunk of one,
or a recompute after preemption), *decode* (solid: one token) or *stalled* (pale: running, but
the step's token budget ran out before its turn). A red ✕ marks a preemption: the victim leaves
its slot and comes back later with a hatched recompute. The bottom row is the waiting queue.
"""
from __future__ import annotations

import time
from html import escape

from .block_map import assign_colors

CSS = """<style>
.batch-timeline {font: 12px/1.4 system-ui, sans-serif; color: #222}
.batch-timeline .tl-title {font-weight: 600; font-size: 13px}
.batch-timeline .tl-grid {display: grid; margin-top: 6px; row-gap: 2px; background: #f4f4f4}
.batch-timeline .tl-label {font-size: 9px; color: #888; padding-right: 4px; text-align: right;
  background: #fff; grid-column: 1}
.batch-timeline .tl-seg {box-sizing: border-box; border-right: 1px solid #fff; overflow: hidden;
  font: bold 9px/14px sans-serif; color: #fff; text-shadow: 0 0 2px #000; white-space: nowrap; padding-left: 2px}
.batch-timeline .tl-prefill {background-image: repeating-linear-gradient(45deg, rgba(0,0,0,.35) 0 2px,
  transparent 2px 5px)}
.batch-timeline .tl-stalled {opacity: .35}
.batch-timeline .tl-preempt {color: #d00; font: bold 12px/14px sans-serif; text-align: center; z-index: 1}
.batch-timeline .tl-queue {align-self: end; background: #999}
.batch-timeline .tl-legend span {display: inline-block; margin: 2px 10px 2px 0}
.batch-timeline .tl-legend i {display: inline-block; width: 18px; height: 10px; margin-right: 4px;
  vertical-align: -1px; background-color: #666}
</style>"""


class BatchTimeline:
    """Slots × steps of one engine run. Display it, then feed it with ``on_step`` or ``record``.

    ``num_slots``: rows to draw (default: the engine's ``max_num_seqs``; above 16, only the slots used).
    ``update_every_s``: how often a live view re-renders (the last step always renders).
    """

    def __init__(self, title: str = "Batch timeline", num_slots: int | None = None, update_every_s: float = 0.3):
        self.title, self.num_slots, self.update_every_s = title, num_slots, update_every_s
        self.cells: list[tuple[int, int, str, str]] = []  # (step, slot, request id, prefill|decode|stalled)
        self.preemptions: list[tuple[int, int, str]] = []  # (step, slot, request id)
        self.queue: list[int] = []  # waiting requests after each step
        self.durations: list[float] = []  # seconds each step took (scheduling, forward pass, sampling)
        self.tokens: list[int] = []  # tokens each step fed the model: the step's work, counted
        self.fed: dict[str, list[int]] = {}  # request id -> tokens it fed, one entry per step it ran in
        self.slot_of: dict[str, int] = {}
        self.colors: dict[str, str] = {}
        self.order: list[str] = []  # request ids in the order they first ran
        self.num_steps, self._last_render, self._html, self._last_index = 0, 0.0, None, None

    # ------------------------------------------------------------------ feeding

    def on_step(self, engine):
        """The ``run_workload`` hook: record the engine's last step, re-render now and then."""
        if self.num_slots is None:
            self.num_slots = engine.config.max_num_seqs
        step = engine.last_step
        if step is None or step.index == self._last_index:
            return  # the engine had nothing to run: no new step to draw
        self._last_index = step.index
        self.record(step)
        now = time.perf_counter()
        if self._html is not None and (not engine.has_unfinished_requests()
                                       or now - self._last_render >= self.update_every_s):
            self.refresh()

    def record(self, step):
        """Add one step's ``SchedulerOutput`` (steps are numbered by arrival here, from 0)."""
        t = self.num_steps
        scheduled = step.scheduled
        for rid in (r.request_id for r in step.preempted):
            if rid in self.slot_of:
                self.preemptions.append((t, self.slot_of.pop(rid), rid))
        for rid in step.running:
            if rid not in self.slot_of:
                used = set(self.slot_of.values())
                self.slot_of[rid] = next(s for s in range(len(used) + 1) if s not in used)
            if rid not in self.order:
                self.order.append(rid)
            if rid in scheduled:
                kind = "prefill" if scheduled[rid][1] else "decode"
                self.fed.setdefault(rid, []).append(scheduled[rid][0])
            else:
                kind = "stalled"
            self.cells.append((t, self.slot_of[rid], rid, kind))
        for req in step.finished:
            self.slot_of.pop(req.request_id, None)
        self.queue.append(len(step.waiting))
        self.durations.append(step.end - step.start)
        self.tokens.append(step.total_tokens)
        self.num_steps += 1

    # ------------------------------------------------------------------ numbers

    def slots_drawn(self) -> int:
        """Rows: every slot of a small batch (idle slots are the point of chapter 04), else those used."""
        used = 1 + max((s for _, s, _, _ in self.cells), default=0)
        return max(used, self.num_slots) if self.num_slots and self.num_slots <= 16 else used

    def summary(self) -> dict:
        """Steps, requests, preemptions and slot use: busy (prefill or decode) cells over all cells."""
        busy = sum(kind != "stalled" for *_, kind in self.cells)
        slots = self.slots_drawn()
        return {"steps": self.num_steps, "requests": len(self.order), "preemptions": len(self.preemptions),
                "mean_batch_size": busy / self.num_steps if self.num_steps else 0.0,
                "slot_use": busy / (slots * self.num_steps) if self.num_steps else 0.0}

    def segments(self):
        """Runs of cells with the same slot, request and kind: ``(slot, request, kind, first step, length)``."""
        runs = []
        for t, slot, rid, kind in sorted(self.cells, key=lambda c: (c[1], c[0])):
            last = runs[-1] if runs else None
            if last and last[:3] == (slot, rid, kind) and last[3] + last[4] == t:
                runs[-1] = (*last[:4], last[4] + 1)
            else:
                runs.append((slot, rid, kind, t, 1))
        return runs

    # ------------------------------------------------------------------ views

    def render_html(self, width: int = 900) -> str:
        assign_colors(self.order, self.colors)
        steps, slots = max(self.num_steps, 1), self.slots_drawn()
        cell = max(1.0, min(14.0, width / steps))
        s = self.summary()
        parts = [f"{s['steps']} steps", f"{s['requests']} requests", f"mean batch {s['mean_batch_size']:.1f}",
                 f"slot use {100 * s['slot_use']:.0f} %", f"{s['preemptions']} preemptions"]
        items = [f'<div class="tl-label" style="grid-row: {r + 1}">slot {r}</div>' for r in range(slots)]
        for slot, rid, kind, t, n in self.segments():
            label = escape(str(rid)) if n * cell >= 7 * len(str(rid)) + 4 and kind != "stalled" else ""
            items.append(f'<div class="tl-seg tl-{kind}" data-request="{escape(str(rid))}" '
                         f'style="grid-row: {slot + 1}; grid-column: {t + 2} / span {n}; '
                         f'background-color: {self.colors[rid]}" '
                         f'title="{escape(str(rid))}: {kind}, steps {t}-{t + n - 1}">{label}</div>')
        for t, slot, rid in self.preemptions:
            items.append(f'<div class="tl-preempt" style="grid-row: {slot + 1}; grid-column: {t + 2}" '
                         f'title="{escape(str(rid))} preempted at step {t}">✕</div>')
        top = max(self.queue, default=0) or 1
        items.append(f'<div class="tl-label" style="grid-row: {slots + 1}">queue</div>')
        items += [f'<div class="tl-queue" style="grid-row: {slots + 1}; grid-column: {t + 2}; '
                  f'height: {100 * q / top:.0f}%" title="step {t}: {q} waiting"></div>'
                  for t, q in enumerate(self.queue) if q]
        grid = (f"grid-template-columns: 44px repeat({steps}, {cell:.2f}px); "
                f"grid-template-rows: repeat({slots}, 14px) 18px")
        legend = ('<span><i class="tl-prefill"></i>prefill / recompute</span><span><i></i>decode</span>'
                  '<span><i class="tl-stalled"></i>stalled (budget spent)</span>'
                  '<span style="color: #d00">✕ preempted</span>')
        return (f'<div class="batch-timeline">{CSS}<div class="tl-title">{escape(self.title)}</div>'
                f'<div class="tl-summary">{" · ".join(parts)}</div><div class="tl-legend">{legend}</div>'
                f'<div class="tl-grid" style="{grid}">{"".join(items)}</div></div>')

    def refresh(self):
        if self._html is not None:
            self._html.value = self.render_html()
            self._last_render = time.perf_counter()

    @property
    def widget(self):
        if self._html is None:
            import ipywidgets as widgets  # a course extra: render_html and plot work without it

            self._html = widgets.HTML()
            self.refresh()
        return self._html

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def plot(self, ax=None, legend: bool = True):
        """The same picture in matplotlib, for slides and reports (legend below the axes)."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        assign_colors(self.order, self.colors)
        if ax is None:
            _, ax = plt.subplots(figsize=(10, 0.45 * self.slots_drawn() + 1.2))
        for slot, rid, kind, t, n in self.segments():
            ax.broken_barh([(t, n)], (slot - 0.4, 0.8), facecolors=self.colors[rid],
                           alpha=0.3 if kind == "stalled" else 1.0, hatch="///" if kind == "prefill" else None,
                           edgecolor="white", linewidth=0.5)
            if kind != "stalled" and n >= 3 * len(str(rid)) * max(1, self.num_steps) / 200:
                ax.text(t + n / 2, slot, str(rid), ha="center", va="center", fontsize=7, color="white")
        for t, slot, _ in self.preemptions:
            ax.plot(t, slot, marker="x", color="#d00", markersize=9, markeredgewidth=2)
        ax.set_ylim(self.slots_drawn() - 0.5, -0.5)
        ax.set_xlim(0, max(self.num_steps, 1))
        ax.set_xlabel("engine step")
        ax.set_ylabel("batch slot")
        ax.set_yticks(range(self.slots_drawn()))
        ax.set_title(self.title, loc="left", fontsize=10)
        if not legend:
            return ax
        ax.legend(handles=[Patch(facecolor="#999", hatch="///", label="prefill / recompute"),
                           Patch(facecolor="#999", label="decode"), Patch(facecolor="#999", alpha=0.3, label="stalled")]
                  + ([plt.Line2D([], [], color="#d00", marker="x", linestyle="", label="preempted")]
                     if self.preemptions else []),
                  loc="upper right", bbox_to_anchor=(1, -0.12 - 1.2 / (0.45 * self.slots_drawn() + 1.2)),
                  fontsize=7, ncols=4, frameon=False)
        return ax
