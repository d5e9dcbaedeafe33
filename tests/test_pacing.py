"""The chapters' times are sized from their cells by labsupport/pacing.py's rule, and the cells keep their budgets."""
import json

import pytest

from labsupport import pacing

CHAPTERS = pacing.chapters()


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_header_and_readme_state_the_time_the_rule_gives(path):
    p = pacing.pace(path)
    said = pacing.stated(path, (pacing.ROOT / "README.md").read_text())
    assert said["header"] == said["README"] == (p.total_min, p.reading_min, p.exercise_min), \
        f"{path.name}: header {said['header']}, README {said['README']}, rule {p.total_min, p.reading_min, p.exercise_min}" \
        " (python -m labsupport.pacing --write rewrites both)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_cell_keeps_its_budget(path):
    assert pacing.pace(path).budget_problems() == []


def _notebook(tmp_path, cells):
    path = tmp_path / "99_made_up.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def md(text):
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def code(text, *tags):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": text, "outputs": [],
            "execution_count": None}


def test_the_rule_counts_visible_words_code_cells_and_exercises_by_kind(tmp_path):
    words = " ".join(["word"] * 300)
    hint = "<details><summary>Hint</summary>" + " ".join(["hidden"] * 900) + "</details>"   # collapsed: not read
    path = _notebook(tmp_path, [
        md("# 99 · Made up\n" + words), md("## 1. Warm-up: a loop\n" + hint), code("x = 1", "exercise"),
        md("## 2. The hard exercise: a scheduler"), code("y = 2", "exercise"),
        md("## 3. Exercise: a policy <!-- " + " ".join(["comment"] * 900) + " -->"), code("z = 3", "exercise"),
        *[code("print(1)") for _ in range(6)]])
    p = pacing.pace(path)
    assert p.words == 300 + 5 + 5 + 7 + 5   # the words shown, headings included; hints and comments not
    assert [kind for _, kind in p.exercises] == ["warm-up", "hard", "exercise"]
    # 317 words at 180 a minute (1.8 min) + 9 code cells x 20 s (3 min), up to 5 min; 10 + 25 + 15 = 50 of exercises
    assert (p.reading_min, p.exercise_min, p.total_min) == (5, 50, 55)
    assert p.header_time().startswith("**Time:** about 55 minutes (5 to read and run, 50 for the exercises: a warm-up "
                                      "(10), an exercise (15) and the hard exercise (25))")


def test_headings_in_code_fences_and_hints_do_not_name_an_exercise_and_hardware_is_not_hard():
    assert pacing.headings("## 2. Warm-up: a loop\n```\n# a comment in a fence\n```\n<details># hidden</details>") == \
        ["Warm-up: a loop"]
    assert pacing.exercise_kind("Exercise: the hardware counters") == "exercise"
    assert pacing.exercise_kind("Exercise (the hard part): schedule()") == "hard"


def test_a_wall_of_text_and_a_cell_of_formatting_are_caught(tmp_path):
    path = _notebook(tmp_path, [md("# 99 · Made up\n" + "w " * 540), md("w " * 501),
                                code("\n".join(f"x{i} = {i}" for i in range(61))),
                                code("\n".join(f"y{i} = {i}" for i in range(80)), "exercise")])
    problems = pacing.pace(path).budget_problems()
    # the opening cell may hold 550 words; another cell 500; an exercise cell is the attendee's and is not held to 60
    assert len(problems) == 2 and "cell 1 shows 501 words" in problems[0] and "code cell 2 holds 61 lines" in problems[1]


def test_a_header_that_disagrees_with_the_rule_is_reported(tmp_path):
    path = _notebook(tmp_path, [md("# 99 · Made up\n**Time:** about 40 minutes (30 to read and run, 10 for the warm-up)."),
                                md("## 1. Warm-up: a loop"), code("x = 1", "exercise")])
    readme = "| 99 | [`99_made_up.ipynb`](notebooks/99_made_up.ipynb) | a loop | 15 min: 5 reading and running, 10 exercises (its last run: 0.1 min) |"
    said = pacing.stated(path, readme)
    p = pacing.pace(path)
    assert said["header"] == (40, 30, 10) != (p.total_min, p.reading_min, p.exercise_min) == said["README"] == (15, 5, 10)
