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
process's PSS makes the system walk its page tables, about 15 ms of CPU for a process holding torch
and a model: every 2 s, nine processes cost a few percent of one core, and the memory of a chapter
rises in steps that last far longer than that.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import psutil

GB = 1e9


def tree_memory() -> tuple[int, int, int]:
    """(sum of PSS, or RSS where PSS is unknown; sum of RSS; processes) of this process and its descendants."""
    me = psutil.Process(os.getpid())
    held = rss = count = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            info = p.memory_full_info() if hasattr(psutil.Process, "memory_full_info") else p.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        held, rss, count = held + getattr(info, "pss", info.rss), rss + info.rss, count + 1
    return held, rss, count


class TreeMemory:
    """The peak of ``tree_memory()`` every ``interval_s`` seconds since ``start()``."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.peak = self.peak_rss = self.peak_processes = 0
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
        held, rss, count = tree_memory()
        if held > self.peak:
            self.peak, self.peak_rss, self.peak_processes = held, rss, count
            self.peak_at = time.perf_counter() - self.started

    def stop(self) -> "TreeMemory":
        self._stop.set()
        self.sample()
        return self

    def report(self) -> str:
        what = "sum of PSS: shared pages counted once" if self.has_pss else "sum of RSS (no PSS on this system)"
        return (f"peak memory of this kernel and its {self.peak_processes - 1} child processes: "
                f"{self.peak / GB:.2f} GB ({what}; sum of RSS {self.peak_rss / GB:.2f} GB), "
                f"{self.peak_at:.0f} s after the start")

    def __del__(self):
        self._stop.set()
