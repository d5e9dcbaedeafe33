"""Keep freed activation memory inside the process on a Linux CPU, instead of handing it back each step.

A prefill step of 32 prompts x 200 tokens allocates activations of 15 to 80 MB (the stacked gate/up
product alone is [6400, 3072] floats). glibc's ``malloc`` serves a block that large with a fresh
``mmap`` and returns it with ``munmap`` when it is freed, so the next layer's tensor of the same size
lands on fresh pages: one page fault per 4 KB, about 19,000 for that product, so filling a new tensor
costs several times the arithmetic into a reused one (``benchmarks/README.md``: the figures). A GPU has its caching
allocator for this; PyTorch's CPU allocator has none.

Three ``mallopt`` settings keep the memory: ``M_MMAP_MAX = 0`` (every block comes from the heap),
``M_TRIM_THRESHOLD = 256 MB`` and ``M_TOP_PAD = 64 MB`` (free memory at the top of the heap is handed
back only past 256 MB, so at most that much freed memory stays resident there; a freed block in the
middle of the heap stays as it does under any ``malloc``). Prefill steps, whose tensors are large, get
faster; decode steps, whose tensors are small, do not change. vLLM's CPU guide gets the
same effect by preloading tcmalloc (``LD_PRELOAD``), which a notebook kernel cannot do after it started.

It applies to the whole process, once, when the first CPU engine is built; set the environment
variable ``LABSUPPORT_KEEP_FREED_MEMORY=0`` to leave ``malloc`` as it was. Other C libraries (musl, macOS,
Windows) are left alone.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's <malloc.h>
TRIM_THRESHOLD_BYTES, TOP_PAD_BYTES = 256 << 20, 64 << 20

_applied: bool | None = None  # None: not tried yet


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True if they are in force."""
    global _applied
    if _applied is None:
        _applied = False
        if (os.environ.get("LABSUPPORT_KEEP_FREED_MEMORY", "1") != "0" and platform.system() == "Linux"
                and platform.libc_ver()[0] == "glibc"):
            try:
                mallopt = ctypes.CDLL(None).mallopt
                _applied = all(mallopt(option, value) == 1 for option, value in
                               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES)))
            except (OSError, AttributeError):
                pass
    return _applied


def release_freed_memory() -> bool:
    """Hand the pages of freed memory back to the system now (glibc's ``malloc_trim``), wherever they lie in the
    heap: after a one-off allocation far larger than a step's (``models/cpu_weights.py`` builds a model once
    and drops it), the settings above would keep up to ``TRIM_THRESHOLD_BYTES`` of it. True if it ran."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        ctypes.CDLL(None).malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
