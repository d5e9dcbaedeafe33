"""The attendee versions of the chapters are generated from the chapters and kept in sync."""
import pytest

from labsupport import exercises

from notebook_tools import CHAPTERS, read


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_exercise_notebook_is_in_sync_with_its_chapter(path):
    target = exercises.exercise_path(path)
    assert target.exists(), f"run `make exercises` to create {target.name}"
    assert target.read_text() == exercises.render(path), f"{target} is stale: run `make exercises`"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_chapter_has_an_exercise_with_a_revealable_solution(path):
    tagged = [c for c in read(path).cells if "exercise" in c.metadata.get("tags", [])]
    assert tagged, f"{path.name} has no cell tagged 'exercise'"
    student = read(exercises.exercise_path(path))
    for i, cell in enumerate(student.cells):
        if "exercise" in cell.metadata.get("tags", []):
            assert exercises.STUB in cell.source and exercises.BEGIN not in cell.source
            reveal = student.cells[i + 1]
            assert reveal.cell_type == "markdown" and "Reveal the reference solution" in reveal.source
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    assert "widgets" not in student.metadata, "stale widget state in the attendee version"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapters_keep_no_stale_progress_bars(path):
    bars = [i for i, c in enumerate(read(path).cells) if c.cell_type == "code"
            for o in c.outputs if exercises.is_progress_bar(o)]
    assert not bars, f"{path.name}: saved tqdm bars in cells {bars} (run `make exercises`)"


def test_clean_chapter_drops_progress_bars_and_keeps_other_widgets():
    import nbformat
    bar = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": "a", "version_major": 2, "version_minor": 0},
        "text/plain": "Benchmark:   0%|          | 0/16 [00:00<?, ?req/s]"})
    widget = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": "b", "version_major": 2, "version_minor": 0},
        "text/plain": "BatchTimeline(steps=12)"})
    text = nbformat.v4.new_output("stream", text="5/16 done [fast]\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[bar, widget, text])])
    assert exercises.clean_chapter(nb) and nb.cells[0].outputs == [widget, text]
    assert not exercises.clean_chapter(nb)


def test_solution_is_cut_out_and_kept_for_the_reveal():
    src = "def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    y = x * 2\n    # END SOLUTION\n    return y"
    student, solution = exercises.split_solution(src)
    assert "x * 2" not in student and "x * 2" in solution
    assert "    raise NotImplementedError" in student  # indentation kept
    assert student.rstrip().endswith("return y")


@pytest.mark.parametrize("src", ["x = 1", "# BEGIN SOLUTION\nx = 1", "# END SOLUTION",
                                 "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION"])
def test_malformed_solution_markers_are_rejected(src):
    with pytest.raises(ValueError):
        exercises.split_solution(src)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_use_reference_swaps_the_reference_in_for_every_exercise(path):
    """A stuck attendee sets USE_REFERENCE = True and the rest of the chapter runs on the references."""
    import re

    import torch

    from labsupport.engine.scheduler import SchedulerOutput

    nb = read(path)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert "USE_REFERENCE = False" in params.source
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    names = [m.group(2) for c in nb.cells if "exercise" in c.metadata.get("tags", [])
             for m in re.finditer(r"^(def|class) (\w+)", c.source, re.MULTILINE)]
    assert names
    for name in names:
        assert f'{name} = exercises.reference("{name}", globals())' in code, f"{name} has no USE_REFERENCE swap"
        ref = exercises.reference(name, {"torch": torch, "SchedulerOutput": SchedulerOutput})
        assert callable(ref) and ref.__name__ == name
    with pytest.raises(ValueError, match="no exercise"):
        exercises.reference("no_such_exercise")
