"""``make gpu-bundle`` / ``make gpu-course``, the parts that need no network and no GPU: the bundle's parts
join back and a missing or changed one is named; the GPU image meets the lab's pinned requirements; the
course runner goes on past a failing cell, counts cells and checks, and leaves its results in a few files.
(``make gpu-course GPU_COURSE_ARGS=--rehearse`` runs the whole path, chapters 00 and 02, in ``make test``.)"""
import json
import tarfile
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

from labsupport.bench.gpu import gpu_bundle, gpu_course


def test_parts_join_back_to_the_bundle(tmp_path):
    source = tmp_path / "src" / "bundle"
    source.mkdir(parents=True)
    (source / "requirements.txt").write_text("nbclient==0.11.0\n")
    (source / "blob.bin").write_bytes(bytes(range(256)) * 4000)
    tar = tmp_path / "bundle.tar"
    with tarfile.open(tar, "w") as t:
        t.add(source, arcname="bundle")
    out = tmp_path / "gpu-bundle"
    manifest = gpu_bundle.split(tar, out, calls=3)
    for d in out.glob("call*"):
        (d / "manifest.json").write_text(json.dumps(manifest))
    assert [p["call"] for p in manifest["parts"]] == [1, 2, 3]
    assert sum(p["bytes"] for p in manifest["parts"]) == tar.stat().st_size
    unpacked = gpu_bundle.join_parts(out, tmp_path / "work")
    assert (unpacked / "blob.bin").read_bytes() == (source / "blob.bin").read_bytes()
    assert gpu_bundle.join_parts(out, tmp_path / "work") == unpacked  # a second call finds it unpacked


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_missing_or_changed_part_is_named_with_the_command_to_repeat(tmp_path, damage):
    tar = tmp_path / "bundle.tar"
    with tarfile.open(tar, "w") as t:
        t.add(Path(gpu_bundle.__file__), arcname="bundle/gpu_bundle.py")
    out = tmp_path / "gpu-bundle"
    manifest = gpu_bundle.split(tar, out, calls=2)
    for d in out.glob("call*"):
        (d / "manifest.json").write_text(json.dumps(manifest))
    part = out / manifest["parts"][1]["path"]
    if damage == "missing":
        part.unlink()
    else:
        part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="part 2 .*carry call2 again"):
        gpu_bundle.join_parts(out, tmp_path / "work")
    assert gpu_bundle.status(out) == 0  # status only reports


def test_the_gpu_image_meets_the_labs_pinned_requirements():
    image = gpu_bundle.image_packages()
    assert image["torch"] and image["transformers"] and image["triton"]  # the versions the course is checked on
    for line in gpu_bundle.lab_dependencies() + gpu_bundle.RUNTIME:
        req = Requirement(line)
        have = image.get(gpu_bundle.canonical(req.name))
        if have:
            assert req.specifier.contains(have), f"{line}: the GPU image has {have}"
    assert "torch" not in {gpu_bundle.canonical(Requirement(d).name) for d in gpu_bundle.lab_dependencies()}


def _notebook(path: Path, sources: list[str]):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# tiny")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="\u2713 the committed check\n")]
    nbformat.write(nb, path)


def test_the_runner_goes_on_past_a_failing_cell_and_reports_it(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "00_fine.ipynb", ['print("\\u2713 a check passed")', "import matplotlib.pyplot as plt\n"
                                            "plt.plot([1, 2]); plt.show()"])
    _notebook(notebooks / "01_broken.ipynb", ['print("\\u2713 first")', "assert 1 == 2, 'planted'", 'print("after")'])
    monkeypatch.setattr(gpu_course, "NOTEBOOKS", notebooks)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    out, archive = tmp_path / "out", tmp_path / "archive"
    assert gpu_course.main(["--out", str(out), "--archive", str(archive), "--cell-timeout", "120"]) == 1
    summary = json.loads((archive / "gpu-course.json").read_text())
    fine, broken = summary["chapters"]
    assert fine["ok"] and fine["cells_run"] == 2 and (fine["checks"], fine["checks_expected"]) == (1, 1)
    assert not broken["ok"] and broken["cells_run"] == 3 and broken["failed"] == [2]
    assert "AssertionError: planted" in broken["first_error"]
    ran = nbformat.read(out / "notebooks" / "01_broken.ipynb", as_version=4)
    assert ran.cells[3].outputs[0]["text"] == "after\n"  # the cell after the failure ran
    assert sorted(p.name for p in archive.iterdir()) == ["gpu-course.json", "gpu-course.md", "gpu-course.tar.gz"]
    with tarfile.open(archive / "gpu-course.tar.gz") as t:
        names = t.getnames()
    assert "gpu-course/notebooks/00_fine.ipynb" in names and "gpu-course/figures/00_cell02.png" in names
    assert "| 01_broken | 3/3 | 1 | 1/1 |" in (archive / "gpu-course.md").read_text()


def test_chapters_are_chosen_by_number():
    assert [p.name[:2] for p in gpu_course.chapters("00,02")] == ["00", "02"]
    # in the order given: docs/gpu.md's order runs what teaches most first, before the deadline can stop it
    assert [p.name[:2] for p in gpu_course.chapters("09,07,06,02,07")] == ["09", "07", "06", "02"]
    assert len(gpu_course.chapters("all")) == len(list(gpu_course.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
    with pytest.raises(SystemExit, match="no chapter 42"):
        gpu_course.chapters("42")


def test_a_cell_cut_by_the_deadline_is_a_stop_not_a_failure(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "00_slow.ipynb", ['print("\u2713 quick")', "import time\ntime.sleep(120)", 'print("never")'])
    monkeypatch.setattr(gpu_course, "MIN_CELL_S", 1)
    import time
    row = gpu_course.run_chapter(notebooks / "00_slow.ipynb", tmp_path / "out", cell_timeout=120,
                                 deadline=time.monotonic() + 20)
    assert row["failed"] == [] and row["first_error"] is None and row["cells_run"] == 1
    assert row["stopped"] == "the run's deadline interrupted cell 2" and not row["ok"]
    late = gpu_course.run_chapter(notebooks / "00_slow.ipynb", tmp_path / "late", cell_timeout=120,
                                  deadline=time.monotonic() + 0.5)  # less than a cell's minimum left: none starts
    assert late["cells_run"] == 0 and not late["failed"]
    assert late["stopped"] == "the run's deadline passed before cell 1"


def test_labsupport_dtype_replaces_auto_and_nothing_else(monkeypatch):
    import torch

    from labsupport.models import loader

    cpu = torch.device("cpu")
    assert loader.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setenv("LABSUPPORT_DTYPE", "bfloat16")
    assert loader.resolve_dtype("auto", cpu) == torch.bfloat16
    assert loader.resolve_dtype("float32", cpu) == torch.float32  # an engine's own choice stays


def test_the_bundle_carries_the_model_wheel_the_makefile_installs():
    import re

    makefile = (gpu_bundle.ROOT / "Makefile").read_text()
    assert re.search(r"SMOLLM\s*:=\s*(\S+)", makefile).group(1) == gpu_bundle.MODEL_WHEEL
