"""Helpers for tests that read the chapter notebooks."""
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def read(path):
    return nbformat.read(path, as_version=4)


def exercise_solutions(path) -> dict:
    """Execute every ``exercise`` cell of a chapter (the reference solutions) and return its names."""
    import math

    import torch

    from labsupport.engine.scheduler import SchedulerOutput
    # what the chapters' set-up cells import and their exercise cells use
    namespace = {"torch": torch, "math": math, "SchedulerOutput": SchedulerOutput}
    for cell in read(path).cells:
        if cell.cell_type == "code" and "exercise" in cell.metadata.get("tags", []):
            exec(cell.source, namespace)
    return namespace


def chapter(prefix: str) -> Path:
    return next(p for p in CHAPTERS if p.name.startswith(prefix))
