"""The one way this package builds its C++ kernels: a named extension from files of ``csrc/``.

An extension's files are compiled as one translation unit, in the order given, so a later file calls an
earlier one's kernels directly (the decode layer calls the products, the norms and the attention) and the
compiler sees them all, as it did when they were one source. Each file ``#include "vectors.h"`` for the
vector type and the polynomial ``exp``; the header is read once.

``compile_extension`` compiles once per machine with ``torch.utils.cpp_extension`` (a C++ compiler,
``ninja`` and a wait; cached under ``~/.cache/torch_extensions``, one build per instruction set so a shared
cache stays safe, and one per Python environment: ninja rebuilds whenever the compile command changes, and
two environments' commands differ in their include paths, so two venvs sharing one folder would rebuild each
other's every start). The engine builds its kernels when it starts on a CPU, and ``python -m labsupport
prepare`` ahead of that, so no chapter waits on a compiler mid-step; a forward pass only uses what is already
built. Where nothing can be built (a laptop without a compiler), the reason is kept and PyTorch's code runs.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"  # the C++ sources, shipped with the package (pyproject's package-data)

_lock = threading.Lock()
_built: dict[str, tuple[object, str]] = {}  # name -> (module or None, why not)


def sources(files: list[str]) -> list[str]:
    """The text of ``csrc/`` files, for ``load_inline``, which joins them into one translation unit."""
    return [(CSRC / f).read_text() for f in files]


def vector_flags() -> list[str]:
    """The instruction set this machine's build targets, by what PyTorch found on this CPU."""
    cap = torch.backends.cpu.get_cpu_capability()
    vector = ["-mavx2", "-mfma"] if cap in ("AVX2", "AVX512") else []  # wider vectors and FMA: faster than SSE2
    return vector + (["-mavx512f"] if cap == "AVX512" else [])  # vectors.h: sixteen floats wide


def compile_extension(name: str, what: str, files: list[str], functions: list[str],
                      extra_cflags=()) -> tuple[object, str]:
    """Compile ``files`` of ``csrc/`` (or load their cached build) once per process: (module, "") or
    (None, why not), the reason naming ``what`` was being built."""
    with _lock:
        if name not in _built:
            try:
                from torch.utils.cpp_extension import load_inline
                _put_ninja_on_path()
                cap = torch.backends.cpu.get_cpu_capability()  # one build per instruction set
                module_name = f"labsupport_{name}_{cap.lower()}"
                directory = _build_directory(module_name)
                with exclusive_build(directory):
                    module = load_inline(module_name, cpp_sources=sources(files), functions=functions,
                                         extra_cflags=["-O3", "-fopenmp", *vector_flags(), *extra_cflags],
                                         extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                                         build_directory=directory, verbose=False)
                _built[name] = (module, "")
            except Exception as exc:  # no compiler, no headers, an unsupported platform: keep the PyTorch path
                _built[name] = (None, f"{what} could not be built ({type(exc).__name__}: {str(exc)[:300]})")
        return _built[name]


def built(name: str):
    """The extension ``compile_extension`` built under ``name``, or None: not built (yet), or it could not be."""
    return _built.get(name, (None,))[0]


def _build_directory(module_name: str) -> str:
    """``~/.cache/torch_extensions/labsupport-<environment>/<module>`` (``TORCH_EXTENSIONS_DIR`` moves the root):
    one folder per Python environment, torch version and copy of this package, so that two venvs (a clone's CI
    run beside a working copy, a notebook kernel beside a terminal) or two checkouts sharing a venv never rebuild
    each other's extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = hashlib.sha1(f"{sys.prefix}|{torch.__version__}|{package}".encode()).hexdigest()[:10]
    path = os.path.join(root, f"labsupport-{environment}", module_name)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive_build(directory: str):
    """Hold ``directory``'s build for this process alone, across processes (two pytest workers, a notebook
    kernel beside ``prepare``).

    torch's builder marks a build in progress with a ``lock`` file that it creates and removes itself; a build
    killed midway (Ctrl-C, a timeout) leaves the file behind and every later start waits on it forever. Guessing
    its staleness from its age raced: two processes could both find an old file, one remove it and start a
    build, and the other then remove the *new* file and build over it. Here every build first takes an
    ``fcntl`` lock on ``build.flock`` beside it. The kernel drops that lock when its holder exits, however it
    exits, so a process holding it knows no other build of ours is running: any ``lock`` file still there was
    left by a dead one and is removed, and the wait is for a live build only."""
    with open(os.path.join(directory, "build.flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by close, or by the kernel if this process dies
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, "lock"))  # torch's baton, left by a build that was killed
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _put_ninja_on_path():
    """The build runs ``ninja``: always the pip package's copy (a dependency of this package), first on PATH.
    Not the first one PATH happens to hold: a machine's own ninja (Debian's 1.11) and the pip package's (1.13)
    hash a build's command differently, so each of them finds the other's log stale and rebuilds every
    extension from scratch. A terminal with the venv activated found the pip copy, a Jupyter kernel or
    ``.venv/bin/python`` without it found Debian's, and every switch between the two paid that rebuild."""
    try:
        import ninja
    except ImportError:
        return  # the machine's, if it has one
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
