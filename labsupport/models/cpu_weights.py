"""The CPU's weights in one file that every process maps: loaded once per machine, shared by all.

On the CPU a model's weights take three forms in memory: the checkpoint's tensors, the stacked
q/k/v and gate/up matrices (``llama.fuse_projections``) and the products' packed copies
(``products.pack_cpu_weights``). For SmolLM2-135M in float32 that is 0.51 GB of file pages mapped
from the safetensors file plus 0.34 GB of stacks and 0.51 GB of packed copies made in each process:
about 1.4 GB per process, and chapter 07 runs five processes that each hold the same bytes.

So the finished forms are saved once, as they are, in a cache file (``torch.save``), and every
process maps that file instead of rebuilding them (``torch.load(mmap=True)``): the pages live once
in the operating system's page cache, whichever processes map them, and they are clean file pages,
which the system can drop under pressure and read back. Same tensors, same layouts, same kernels:
the tokens do not change. The first process to need the file builds it (the others wait on a lock),
and a rewritten checkpoint, another torch or another kernel build gets a new file
(``cache_key``); older files of the same checkpoint are removed.

Only for float32 on the CPU, for models of at least ``MIN_BYTES`` (a tiny test model gains nothing),
and where the packed copies can be saved (oneDNN's opaque packed layout, used where the C++ kernels
are not built, cannot): everywhere else ``loader.shared_weights`` loads as before. Set
``LABSUPPORT_MAPPED_WEIGHTS=0`` to turn it off.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when the saved forms change (stacking, packing)
MIN_BYTES = 32 << 20
unsavable: set[Path] = set()  # files this process found it cannot write (oneDNN layouts, a read-only cache)


def enabled(device: torch.device, dtype: torch.dtype, folder: Path) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and os.environ.get("LABSUPPORT_MAPPED_WEIGHTS", "1") != "0"
            and sum(p.stat().st_size for p in folder.glob("*.safetensors")) >= MIN_BYTES)


def cache_key(folder: Path, stamp: tuple, tied: bool) -> str:
    """What the saved forms depend on: the checkpoint (path, sizes, times), the layout, torch and the kernels."""
    from ..kernels import cpu_products
    parts = (LAYOUT_VERSION, str(folder.resolve()), stamp, tied, torch.__version__, cpu_products.panel_width(),
             cpu_products.thin_rows())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def cache_file(cache: Path, folder: Path, key: str) -> Path:
    """The file of ``folder``'s forms under ``cache`` (``loader.cache_dir()``, which imports this file)."""
    where = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:8]
    return cache / "cpu-weights" / f"{folder.name}-{where}-{key}.pt"


def ensure(cache: Path, folder: Path, stamp: tuple, tied: bool, build) -> bool:
    """Make the file of ``folder`` if it is missing, from ``build()`` (a model built the ordinary way, whose
    ``shared_weights`` are saved and then dropped); True if the file is there now. A file that cannot be
    written (a full disk, a read-only cache, oneDNN's layouts) is not tried again by this process: it
    loads as before."""
    path = cache_file(cache, folder, cache_key(folder, stamp, tied))
    if path.exists() or path in unsavable:
        return path.exists()
    try:
        with build_lock(path):
            if not path.exists():  # nobody built it while we waited
                net = build()
                if savable(net.shared_weights.packed):
                    save(path, net.shared_weights, net.shared_weights.packed)
                else:
                    unsavable.add(path)
                del net
                from ..kernels.cpu_memory import release_freed_memory
                release_freed_memory()  # the built copies: give their pages back, the file's take their place
    except OSError as exc:
        log.warning("cannot write the CPU weights file %s (%s): each process keeps its own copy", path, exc)
        unsavable.add(path)
    return path.exists()


def load(path: Path) -> tuple[dict, dict] | None:
    """(weights, packed copies) mapped from ``path``, or None if it is missing or unreadable."""
    if not path.exists():
        return None
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
        return saved["weights"], saved["packed"]
    except Exception:  # a truncated or foreign file: rebuild it
        return None


def savable(packed: dict) -> bool:
    return all(t is None or not t.is_mkldnn for t in packed.values())


def save(path: Path, weights: dict, packed: dict):
    """Write atomically (a reader never sees half a file) and remove older files of the same checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"weights": dict(weights), "packed": dict(packed)}, f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    stem = path.name.rsplit("-", 1)[0]
    for old in path.parent.glob(f"{stem}-*.pt"):
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()


@contextlib.contextmanager
def build_lock(path: Path):
    """One builder at a time for ``path`` (chapter 07 starts four workers at once); no-op without ``fcntl``."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
