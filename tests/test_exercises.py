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
    stubs = [c for c in student.cells if "exercise" in c.metadata.get("tags", [])]
    assert len(stubs) == len(tagged)
    assert all("# Your code here" in c.source and exercises.BEGIN not in c.source for c in stubs)
    for stub, solution in zip(stubs, tagged):
        # Run All gets past every stub: a stub raises only inside a function, when called by its check; an answer
        # at the top level keeps the placeholders its cell sets before the solution, and the check says what is missing
        assert not [line for line in stub.source.splitlines() if line.startswith("raise")], stub.source
        if exercises.STUB not in stub.source:
            assert all(f"{name} = None" in stub.source for name in exercises.exercise_names(solution.source)), \
                f"{path.name}: a top-level answer without its placeholders:\n{stub.source}"
    assert len([c for c in student.cells if is_reveal(c)]) == len(tagged), "one reveal per exercise"
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    assert "widgets" not in student.metadata, "stale widget state in the attendee version"


def is_reveal(cell):
    return cell.cell_type == "markdown" and "Reveal the reference solution" in cell.source


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_reveal_comes_right_after_its_exercises_check(path):
    """An attendee meets the check of their attempt before the answer: between an exercise's stub and the
    first code cell that swaps in its reference (its check cell) there is no reveal; right after it, there is."""
    import re

    cells = read(exercises.exercise_path(path)).cells
    # the names come from the chapter's cell: a stub whose whole body is the attendee's part defines none
    solutions = [c for c in read(path).cells if "exercise" in c.metadata.get("tags", [])]
    stubs = [i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])]
    assert len(stubs) == len(solutions), f"{path.name}: {len(stubs)} stubs for {len(solutions)} exercises"
    for i, solution in zip(stubs, solutions):
        names = re.findall(r"^(?:def|class) (\w+)", solution.source, re.MULTILINE)
        check = next((j for j in range(i + 1, len(cells)) if cells[j].cell_type == "code"
                      and set(names) & set(exercises.swapped_names(cells[j].source))), None)
        assert check is not None, f"{path.name}: the exercise defining {names} has no check cell after it"
        early = [j for j in range(i + 1, check) if is_reveal(cells[j])]
        assert not early, f"{path.name}: the reveal of {names} (cell {early[0]}) precedes its check (cell {check})"
        assert is_reveal(cells[check + 1]) and any(f"def {n}(" in cells[check + 1].source or f"class {n}" in
                                                   cells[check + 1].source for n in names), \
            f"{path.name}: no reveal of {names} right after its check (cell {check})"


def test_reveal_is_placed_after_the_check_even_past_other_cells():
    """The generator itself, on a small notebook: prose between stub and check, two exercises in a row."""
    import nbformat

    new = nbformat.v4
    nb = new.new_notebook(cells=[
        new.new_code_cell("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION", metadata={"tags": ["exercise"]}),
        new.new_markdown_cell("Run the check."),
        new.new_code_cell("print('not a check')"),
        new.new_code_cell('if USE_REFERENCE:\n    f = exercises.reference("f", globals())\ncheck(f)'),
        new.new_code_cell("def g():\n    # BEGIN SOLUTION\n    return 2\n    # END SOLUTION", metadata={"tags": ["exercise"]}),
        new.new_code_cell('if USE_REFERENCE:\n    g = exercises.reference("g", globals())\ncheck(g)'),
    ])
    cells = exercises.student_notebook(nb).cells
    kinds = ["reveal " + ("f" if "return 1" in c.source else "g") if is_reveal(c) else c.cell_type for c in cells]
    assert kinds == ["code", "markdown", "code", "code", "reveal f", "code", "code", "reveal g"]


def test_an_exercise_without_a_check_cell_is_refused():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION",
                                  metadata={"tags": ["exercise"]}),
        nbformat.v4.new_code_cell("check(f)")])   # no reference swap: nothing marks it as f's check
    with pytest.raises(ValueError, match="no check cell"):
        exercises.student_notebook(nb)


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


def test_a_top_level_answer_gets_no_raise_and_keeps_its_placeholder():
    """A cell whose solution is at the top level (an answer, not a function's body) must not stop Run All: its
    stub keeps the placeholder set before the solution, and the check cell says what is missing."""
    src = "ANSWER = None\n# BEGIN SOLUTION\nANSWER = 42\n# END SOLUTION"
    student, solution = exercises.split_solution(src)
    assert "42" not in student and "42" in solution and "raise" not in student
    scope = {}
    exec(student, scope)
    assert scope["ANSWER"] is None


def test_a_check_cell_may_swap_in_a_drawn_reference():
    """An answer that depends on a seeded draw (chapter 03's planted bug) is swapped in from the draw itself."""
    import nbformat

    new = nbformat.v4
    nb = new.new_notebook(cells=[
        new.new_code_cell("NAME = None\n# BEGIN SOLUTION\nNAME = 'a'\n# END SOLUTION", metadata={"tags": ["exercise"]}),
        new.new_code_cell("print('evidence')"),
        new.new_code_cell("if USE_REFERENCE:\n    NAME, fix = bug.reference()\ncheck(bug, NAME, fix)")])
    cells = exercises.student_notebook(nb).cells
    assert [is_reveal(c) for c in cells] == [False, False, False, True]
    source = 'x = exercises.reference("x", globals())\na, b = bug.reference()\nc == d.reference()'
    assert exercises.swapped_names(source) == ["x", "a", "b"]


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
        assert name in exercises.swapped_names(code), f"{name} has no USE_REFERENCE swap"
        ref = exercises.reference(name, {"torch": torch, "SchedulerOutput": SchedulerOutput})
        assert callable(ref) and ref.__name__ == name
    with pytest.raises(ValueError, match="no exercise"):
        exercises.reference("no_such_exercise")


def exercise_headings(path):
    """The markdown heading that introduces each exercise cell (the last one above it), number stripped:
    "## 3. Warm-up: the chunking rule" -> "Warm-up: the chunking rule"."""
    import re

    headings, last = [], None
    for cell in read(path).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    last = re.sub(r"^#+\s*(\d+\.\s*)?", "", line)
        elif "exercise" in cell.metadata.get("tags", []):
            headings.append(last)
    return headings


# How many warm-ups (transcription exercises: the text gives the steps, the attendee turns them into code)
# each chapter has; the chapters listed here are held to the labelling convention below.
WARM_UPS = {"00_": 1, "02_": 1, "03_": 3, "04_": 0, "05_": 1, "06_": 1}


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.name[:3] in WARM_UPS], ids=lambda p: p.name)
def test_warm_ups_are_labelled_in_their_heading_and_in_the_learning_goals(path):
    """A warm-up's heading starts with "Warm-up:", and the learning goals call it one, so an attendee knows
    which exercise is practice and which is the hard part before starting."""
    headings = exercise_headings(path)
    warm = [h for h in headings if h.startswith("Warm-up:")]
    assert len(warm) == WARM_UPS[path.name[:3]], f"{path.name}: warm-up headings {warm} among {headings}"
    assert not any("warm-up" in h.lower() and not h.startswith("Warm-up:") for h in headings), \
        f"{path.name}: a warm-up heading starts with 'Warm-up:' ({headings})"
    goals = read(path).cells[0].source.lower()
    assert goals.count("warm-up") >= len(warm) and (("warm-up" in goals) == bool(warm)), \
        f"{path.name}: the learning goals and the headings {headings} disagree about warm-ups"
