"""Two processes building the same C++ extension take turns (``labsupport/kernels/jit.py``'s ``exclusive_build``),
and a build killed midway leaves nothing that blocks the next one. Model-free: torch's builder is stood in for
by the ``lock`` file it creates and removes, so no compiler runs. The processes are real (``subprocess``) and
talk through files in the build folder: ``<name>.in`` once inside, ``<name>.go`` to let it finish,
``<name>.out`` with whether its baton survived."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from waiting import wait_until

from labsupport.kernels import jit

pytestmark = pytest.mark.slow  # four Python processes that import torch

BUILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from labsupport.kernels.jit import exclusive_build
    folder, name = Path(sys.argv[1]), sys.argv[2]
    (folder / f"{name}.ready").touch()  # imported: next, the lock
    with exclusive_build(str(folder)):
        baton = folder / "lock"  # what torch's builder creates while it compiles
        baton.touch()
        (folder / f"{name}.in").touch()
        while not (folder / f"{name}.go").exists():  # the compile, for as long as the test says
            time.sleep(0.02)
        (folder / f"{name}.out").write_text(str(baton.exists()))
        baton.unlink()
""")


def _build(folder: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", BUILD, str(folder), name], env=env)


def test_a_second_process_waits_for_the_first_build_and_leaves_its_baton_alone(tmp_path):
    a = _build(tmp_path, "a")
    b = None
    try:
        wait_until(lambda: (tmp_path / "a.in").exists(), 60)
        b = _build(tmp_path, "b")
        wait_until(lambda: (tmp_path / "b.ready").exists(), 60)
        # b is at the lock while a still builds: a bounded look at something that must not happen
        try:
            b.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        assert b.poll() is None and not (tmp_path / "b.in").exists(), "the second build went in while the first one ran"
        (tmp_path / "a.go").touch()
        assert wait_until(lambda: (tmp_path / "a.out").exists() and (tmp_path / "a.out").read_text(), 60) == "True"
        wait_until(lambda: (tmp_path / "b.in").exists(), 60)  # the first one done: the second goes on
        (tmp_path / "b.go").touch()
        assert wait_until(lambda: (tmp_path / "b.out").exists() and (tmp_path / "b.out").read_text(), 60) == "True"
        assert a.wait(60) == 0 and b.wait(60) == 0
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_build_killed_midway_does_not_block_the_next(tmp_path):
    a = _build(tmp_path, "a")
    try:
        wait_until(lambda: (tmp_path / "a.in").exists(), 60)
    finally:
        a.kill()  # Ctrl-C or a timeout in the middle of a compile
        a.wait()
    assert (tmp_path / "lock").exists()  # what torch's builder would wait on forever
    (tmp_path / "b.go").touch()
    b = _build(tmp_path, "b")
    try:
        assert b.wait(60) == 0, "the next build did not finish"
    finally:
        if b.poll() is None:
            b.kill()
    assert (tmp_path / "b.out").read_text() == "True" and not (tmp_path / "lock").exists()


def test_the_build_always_runs_the_pip_packages_ninja(tmp_path, monkeypatch):
    """A machine's own ninja first on PATH (Debian's 1.11 beside the pip package's 1.13) must not be the one
    the build runs: the two hash a build's command differently, and each rebuilt every extension after the
    other. The pip copy goes first on PATH, whatever PATH held, and only once."""
    ninja = pytest.importorskip("ninja")
    own = tmp_path / "bin"
    own.mkdir()
    (own / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (own / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{own}{os.pathsep}/usr/bin{os.pathsep}/bin")
    jit._put_ninja_on_path()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    jit._put_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep).count(ninja.BIN_DIR) == 1
