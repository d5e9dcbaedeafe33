"""Every chapter notebook executed top to bottom, as an attendee's "Restart & Run All" would, on this machine.

    python -m labsupport.bench.gpu.gpu_course --out build/gpu-course/out [--chapters 00,02] [--archive DIR]

Made for a GPU machine (``make gpu-course``, docs/gpu.md), and it runs anywhere the chapters do. Each
chapter runs in a fresh Jupyter kernel (nbclient) from the notebooks' folder with its parameters as
committed (``DEVICE = "auto"``: CUDA where there is one, with each chapter's GPU scale). A failing cell does
not stop its chapter: the cells after it run too, so one run shows every failure. It writes

* ``notebooks/NN_*.ipynb``, the executed copies, and ``figures/NN_cellK.png``, every figure they drew;
* ``gpu-course.json`` and ``gpu-course.md``: per chapter the cells run and failed, the exercise checks
  passed (a line starting with a check mark, against the committed notebook's count), the wall time and the
  peak device memory (the GPU's used memory, all processes, read by NVML; on a CPU the resident memory of
  the kernel and its child processes), and the first error;
* ``gpu-course.tar.gz`` of all of it, into ``--archive`` as well (with the two summaries beside it: three
  files, small enough to come back from a machine that returns few), rewritten after every chapter, so
  whatever has run comes back even if the command is stopped.

Exit status 0 only if every chosen chapter ran every cell without an error.
"""
from __future__ import annotations

import argparse
import base64
import importlib.metadata as metadata
import json
import os
import platform
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = ROOT / "notebooks"
CHECK_MARK = "\u2713"
MIN_CELL_S = 15  # a cell is not started with less of the deadline left: it would be cut off and look failed


def chapters(selected: str | None) -> list[Path]:
    """The chapters to run, in the order given (the order that teaches most first, when time may run out:
    ``docs/gpu.md``); "all" or nothing: every chapter in number order. A chapter named twice runs once."""
    every = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not selected or selected == "all":
        return every
    wanted = list(dict.fromkeys(s.strip() for s in selected.split(",") if s.strip()))
    by_number = {p.name[:2]: p for p in every}
    unknown = [w for w in wanted if w not in by_number]
    if unknown:
        raise SystemExit(f"no chapter {', '.join(unknown)}; there are {', '.join(by_number)}")
    return [by_number[w] for w in wanted]


# ------------------------------------------------------------------ memory, sampled while a chapter runs

class PeakMemory:
    """The peak of the GPU's used memory (NVML: every process on it) or, without a GPU, of the resident
    memory of this process's children (the kernel, its engine and worker processes), sampled every 0.2 s."""

    def __init__(self):
        self.kind, self._read = "none", None
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.kind, self._read = "gpu", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
        except Exception:  # no NVML, no GPU
            try:
                import psutil
                me = psutil.Process()

                def rss():
                    total = 0
                    for child in me.children(recursive=True):
                        try:
                            total += child.memory_info().rss
                        except psutil.Error:
                            pass
                    return total
                self.kind, self._read = "rss", rss
            except ImportError:
                pass
        self.peak, self._stop = 0, threading.Event()

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self):
        while self._read is not None:
            try:
                self.peak = max(self.peak, self._read())
            except Exception:
                return
            if self._stop.wait(0.2):
                return


def device_description() -> dict:
    """What ran it: the GPU (NVML) or CPU, and the versions the chapters depend on (no CUDA context made here)."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count()}
    for name in ("torch", "triton", "transformers", "tokenizers", "nbclient", "ipykernel"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        info["gpu"] = name.decode() if isinstance(name, bytes) else name
        info["gpu_memory_mib"] = pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        info["gpu"] = None
    return info


# ------------------------------------------------------------------ one chapter

def checks_in(cells) -> int:
    """Exercise checks passed: printed lines that start with the check mark (``labsupport.checks``)."""
    count = 0
    for cell in cells:
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if out.get("output_type") == "stream":
                text = out.get("text", "")
                count += sum(line.startswith(CHECK_MARK) for line in ("".join(text) if isinstance(text, list) else text).splitlines())
    return count


def first_error(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {str(out.get('evalue'))[:300]}"
    return None


def run_chapter(path: Path, out: Path, cell_timeout: float, deadline: float | None) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.read(path, as_version=4)
    expected_checks = checks_in(nb.cells)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    for c in nb.cells:  # the committed outputs go; only what this run prints stays
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None

    def timeout_for(_cell):
        left = cell_timeout if deadline is None else min(cell_timeout, deadline - time.monotonic())
        return max(1, int(left))

    client = NotebookClient(nb, kernel_name="python3", timeout=int(cell_timeout), timeout_func=timeout_for,
                            allow_errors=True, interrupt_on_timeout=True, record_timing=True,
                            resources={"metadata": {"path": str(path.parent)}})
    row = {"chapter": path.name[:2], "notebook": path.name, "cells": len(code), "cells_run": 0, "failed": [],
           "checks": 0, "checks_expected": expected_checks, "first_error": None, "stopped": None}
    began = time.perf_counter()
    with PeakMemory() as memory:
        try:
            with client.setup_kernel():
                for index, cell in code:
                    if deadline is not None and deadline - time.monotonic() < MIN_CELL_S:
                        row["stopped"] = f"the run's deadline passed before cell {index}"
                        break
                    cut_short = deadline is not None and deadline - time.monotonic() < cell_timeout
                    client.execute_cell(cell, index)
                    error = first_error(cell)
                    if error and cut_short and time.monotonic() >= deadline - 1:
                        # the deadline, not the cell, ended it: a stop, not a failure of the chapter's code
                        row["stopped"] = f"the run's deadline interrupted cell {index}"
                        break
                    row["cells_run"] += 1
                    if error and "raises-exception" not in cell.metadata.get("tags", []):
                        row["failed"].append(index)
                        row["first_error"] = row["first_error"] or f"cell {index}: {error}"
                    print(f"  {path.name[:2]} cell {index:3d} {'FAILED ' + error if error else 'ok'}"
                          f" ({time.perf_counter() - began:.0f} s)", flush=True)
        except DeadKernelError as exc:
            row["stopped"] = f"the kernel died ({str(exc)[:200]})"
        except Exception as exc:  # the kernel would not start, a timeout it could not recover from
            row["stopped"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["wall_s"] = round(time.perf_counter() - began, 1)
    row["peak_memory_mib"] = memory.peak // 2**20 if memory.peak else None
    row["memory_kind"] = memory.kind
    row["checks"] = checks_in(nb.cells)
    row["ok"] = not row["failed"] and row["stopped"] is None and row["cells_run"] == row["cells"]
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / "notebooks" / path.name)
    save_figures(nb, path.name[:2], out / "figures")
    return row


def save_figures(nb, chapter: str, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    for index, cell in enumerate(nb.cells):
        pngs = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        for k, png in enumerate(pngs):
            name = f"{chapter}_cell{index:02d}" + (f"_{k}" if len(pngs) > 1 else "") + ".png"
            (folder / name).write_bytes(base64.b64decode(png))


# ------------------------------------------------------------------ the summary

def table(rows: list[dict], memory_kind: str) -> str:
    label = {"gpu": "peak GPU memory", "rss": "peak RSS"}.get(memory_kind, "peak memory")
    lines = [f"| chapter | cells run | failed | checks passed | wall time | {label} | first failure |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        why = r["stopped"] or r["first_error"] or ""
        lines.append(f"| {r['notebook'].removesuffix('.ipynb')} | {r['cells_run']}/{r['cells']} | {len(r['failed'])} | "
                     f"{r['checks']}/{r['checks_expected']} | {r['wall_s']:.0f} s | "
                     f"{'' if r['peak_memory_mib'] is None else str(r['peak_memory_mib']) + ' MiB'} | "
                     f"{why.replace('|', '/')[:160]} |")
    return "\n".join(lines)


def write_summary(out: Path, archive: Path | None, info: dict, rows: list[dict], planned: list[str], total_s: float):
    summary = {"machine": info, "chapters": rows, "planned": planned, "total_s": round(total_s, 1),
               "ok": len(rows) == len(planned) and all(r["ok"] for r in rows)}
    kind = next((r["memory_kind"] for r in rows), "none")
    where = info.get("gpu") or f"CPU ({info['cpus']} cores)"
    md = (f"# Course run, {info['date']}: {where}\n\n"
          f"torch {info['torch']}, triton {info['triton']}, transformers {info['transformers']}, Python "
          f"{info['python']}{', driver ' + info['driver'] if info.get('driver') else ''}, dtype {info['dtype']}; "
          f"{len(rows)} of {len(planned)} chapters in {total_s:.0f} s: {'all passed' if summary['ok'] else 'NOT all passed'}\n\n"
          + table(rows, kind) + "\n")
    (out / "gpu-course.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu-course.md").write_text(md)
    with tarfile.open(out / "gpu-course.tar.gz", "w:gz") as tar:
        for name in ("notebooks", "figures", "gpu-course.json", "gpu-course.md"):
            if (out / name).exists():
                tar.add(out / name, arcname=f"gpu-course/{name}")
    if archive is not None:
        archive.mkdir(parents=True, exist_ok=True)
        for name in ("gpu-course.tar.gz", "gpu-course.json", "gpu-course.md"):
            shutil.copy(out / name, archive / name)
    return summary, md


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench.gpu.gpu_course", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "build" / "gpu-course" / "out"))
    parser.add_argument("--archive", default=None, help="also copy the tar.gz and both summaries here (e.g. $OUT)")
    parser.add_argument("--chapters", default="all", help="e.g. 00,02 (default all)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds one cell may take (default 300)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole run: chapters not started by then are skipped, a running one "
                             "stops at its next cell (set it so the results still come back before the command's limit)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16, ...: what dtype='auto' means in every chapter (LABSUPPORT_DTYPE); "
                             "default: the engine's own (bf16 on a GPU)")
    args = parser.parse_args(argv)
    if args.dtype:
        os.environ["LABSUPPORT_DTYPE"] = args.dtype  # the kernels inherit it
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = Path(args.archive) if args.archive else None
    chosen = chapters(args.chapters)
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    info = device_description()
    info["dtype"] = os.environ.get("LABSUPPORT_DTYPE", "auto")
    print(f"executing {len(chosen)} chapters on {info.get('gpu') or 'the CPU'} (torch {info['torch']})", flush=True)
    began, rows = time.perf_counter(), []
    for path in chosen:
        if deadline is not None and time.monotonic() > deadline:
            rows.append({"chapter": path.name[:2], "notebook": path.name, "cells": 0, "cells_run": 0, "failed": [],
                         "checks": 0, "checks_expected": 0, "first_error": None, "wall_s": 0.0,
                         "peak_memory_mib": None, "memory_kind": "none", "ok": False,
                         "stopped": "not started: the run's deadline had passed"})
        else:
            print(f"{path.name}:", flush=True)
            rows.append(run_chapter(path, out, args.cell_timeout, deadline))
        summary, md = write_summary(out, archive, info, rows, [p.name for p in chosen], time.perf_counter() - began)
    print("\n" + md, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
