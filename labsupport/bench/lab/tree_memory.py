"""The memory a process tree really holds: this process and all its descendants, sampled in the background.

A chapter that starts workers (chapter 07: four servers and four routers beside the kernel) must fit
the laptop it runs on, and only the whole tree says whether it does. Summing the processes' RSS
says more than they hold: a page shared by several processes (the weights file every worker maps,
``models/cpu_weights.py``; torch's libraries) is in each one's RSS. Linux's PSS (proportional set
size) charges a shared page to its processes in equal parts, so the sum of PSS over the tree is the
memory it holds; that is the figure reported, beside the sum of RSS. Elsewhere (macOS, Windows)
there is no PSS and the RSS sum stands in for it, an overestimate, and the report says so.

``memory = TreeMemory().start()`` ... ``print(memory.report())``. The sampling thread ends with
``stop()``, or when the object is dropped (re-running a notebook cell starts a new one). Reading a
process's PSS makes the system walk its page tables, which is not free for a process holding torch and a
model (``benchmarks/README.md``), so the tree is sampled every 2 s: the memory of a chapter rises in steps
that last far longer than that.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import psutil

GB = 1e9


def label(p: psutil.Process) -> str:
    """What a process of the tree is, in a word: ``serve``, ``router``, or its program's name."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    if "labsupport" in cmd and cmd.index("labsupport") + 1 < len(cmd):
        return cmd[cmd.index("labsupport") + 1]
    return os.path.basename(cmd[0]) if cmd else "?"


def tree_memory() -> tuple[int, int, list[tuple[str, int]]]:
    """(sum of PSS, or RSS where PSS is unknown; sum of RSS; (label, PSS) of each process) over this process
    and its descendants; this process is labelled "this process"."""
    me = psutil.Process(os.getpid())
    held = rss = 0
    each = []
    for p in [me, *me.children(recursive=True)]:
        try:
            info = p.memory_full_info() if hasattr(psutil.Process, "memory_full_info") else p.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        mine = getattr(info, "pss", info.rss)
        held, rss = held + mine, rss + info.rss
        each.append(("this process" if p.pid == me.pid else label(p), mine))
    return held, rss, each


class TreeMemory:
    """The peak of ``tree_memory()`` every ``interval_s`` seconds since ``start()``."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.peak = self.peak_rss = self.peak_processes = 0
        self.peak_each: list[tuple[str, int]] = []
        self.peak_at = self.started = 0.0
        self.has_pss = hasattr(psutil.Process(os.getpid()).memory_full_info(), "pss")
        self._stop = threading.Event()

    def start(self) -> "TreeMemory":
        self.started = time.perf_counter()
        self.sample()
        ref, stop, interval = weakref.ref(self), self._stop, self.interval_s  # no strong reference to self

        def run():
            while not stop.wait(interval):
                me = ref()
                if me is None:
                    return
                me.sample()
                del me

        threading.Thread(target=run, name="tree-memory", daemon=True).start()
        return self

    def sample(self):
        held, rss, each = tree_memory()
        if held > self.peak:
            self.peak, self.peak_rss, self.peak_processes, self.peak_each = held, rss, len(each), each
            self.peak_at = time.perf_counter() - self.started

    def stop(self) -> "TreeMemory":
        self._stop.set()
        self.sample()
        return self

    def report(self) -> str:
        what = "sum of PSS: shared pages counted once" if self.has_pss else "sum of RSS (no PSS on this system)"
        groups: dict[str, list[int]] = {}
        for name, held in self.peak_each:
            groups.setdefault(name, []).append(held)
        parts = ", ".join(f"{name} {sum(v) / GB:.2f}" if len(v) == 1 else f"{len(v)} x {name} {sum(v) / GB:.2f}"
                          for name, v in groups.items())
        return (f"peak memory of this kernel and its {self.peak_processes - 1} child processes: "
                f"{self.peak / GB:.2f} GB ({what}; sum of RSS {self.peak_rss / GB:.2f} GB), "
                f"{self.peak_at:.0f} s after the start; by process (GB): {parts}")

    def __del__(self):
        self._stop.set()
