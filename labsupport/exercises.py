"""Exercise notebooks from the chapter notebooks: one source, two versions.

A chapter notebook (``notebooks/NN_*.ipynb``) holds the reference solutions and is what CI
executes. A code cell tagged ``exercise`` marks the attendee's part between two lines::

    # BEGIN SOLUTION
    ...reference code...
    # END SOLUTION

``python -m labsupport.exercises`` writes ``notebooks/exercises/NN_*.ipynb``: outputs cleared,
each solution replaced by ``raise NotImplementedError(...)``, and the solution kept in a
collapsed "Reveal the reference solution" cell placed right after the exercise's **check cell**,
not under the stub: an attendee meets the check (and its verdict on their own attempt) before the
answer, yet nobody has to go looking for the answer once they have tried. A solution at the top
level of its cell (an answer such as ``X = ...``, not a function's body) gets no ``raise``: Run All
must get past the stub as it gets past a function whose body raises only when called, so the cell
gives the names a placeholder (``X = None``) before the solution, and the check cell says what is
missing.

A check cell is recognised by what every chapter's check cell already holds, the swap for a stuck
attendee: ``NAME = exercises.reference("NAME", globals())`` for a name the exercise defines (or,
for an answer that depends on a seeded draw, ``NAME, OTHER = thing.reference()``). The first later
code cell with such a line is the exercise's check; an exercise without one is an error, so a
chapter cannot ship a reveal with nothing to check against. A test regenerates the copies and
fails if the committed ones are stale or if any reveal comes before its check.

Stuck? Every chapter's ``parameters`` cell has ``USE_REFERENCE = False``; set it to ``True`` and
each check cell swaps in the reference solution (``reference(name, globals())``, read from the
chapter notebook itself, the one source), so the rest of the chapter runs.
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import nbformat

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
STUB = 'raise NotImplementedError("Exercise: write this part, then run the check cell below")'


def split_solution(source: str) -> tuple[str, str]:
    """Return (student source, solution source) of an exercise cell."""
    student, solution, inside, indent = [], [], False, ""
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN}")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            student.append(f"{indent}# Your code here")
            if indent:  # at the top level the cell runs on (see the module's docstring): the check says what is missing
                student.append(f"{indent}{STUB}")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END} without {BEGIN}")
            inside = False
        elif inside:
            solution.append(line)
        else:
            student.append(line)
    if inside:
        raise ValueError(f"{BEGIN} without {END}")
    if not solution:
        raise ValueError(f"an exercise cell needs a {BEGIN} ... {END} block")
    return "\n".join(student), source


PROGRESS_BAR = re.compile(r"\|\s*\d+/\d+ \[")  # tqdm's text: "Benchmark:   0%|          | 0/16 [00:00<?, ?req/s]"


def is_progress_bar(output) -> bool:
    """A tqdm bar saved as a widget. Its text fallback is the bar as first drawn ("0/16"), so a
    reader without the live widget sees a stale, misleading bar: drop it from saved notebooks."""
    data = output.get("data", {})
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    return "application/vnd.jupyter.widget-view+json" in data and bool(PROGRESS_BAR.search(text))


def clean_chapter(nb: nbformat.NotebookNode) -> bool:
    """Remove saved progress bars from an executed chapter; True if anything changed."""
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code":
            kept = [o for o in cell.outputs if not is_progress_bar(o)]
            changed |= len(kept) != len(cell.outputs)
            cell.outputs = kept
    return changed


DEFINED = re.compile(r"^(?:def|class)\s+(\w+)|^(\w+)\s*=(?!=)", re.MULTILINE)


def is_exercise(cell) -> bool:
    return cell.cell_type == "code" and "exercise" in cell.metadata.get("tags", [])


def exercise_names(source: str) -> list[str]:
    """The names an exercise cell defines at top level (functions, classes, answers like ``X = ...``)."""
    return [a or b for a, b in DEFINED.findall(source)]


SWAP = re.compile(r"^[ \t]*(\w+(?:[ \t]*,[ \t]*\w+)*)[ \t]*=[ \t]*[\w.]+\.reference\(", re.MULTILINE)


def swapped_names(source: str) -> list[str]:
    """The names a cell swaps a reference in for: ``X = exercises.reference("X", globals())`` or
    ``X, Y = bug.reference()``."""
    return [name.strip() for targets in SWAP.findall(source) for name in targets.split(",")]


def is_check_of(cell, names) -> bool:
    """Whether ``cell`` checks an exercise defining ``names``: it swaps in the reference of one of them."""
    return cell.cell_type == "code" and bool(set(swapped_names(cell.source)) & set(names))


def check_cell_index(cells, exercise: int) -> int:
    """Index of the check cell of the exercise at ``cells[exercise]``: the first later code cell that
    swaps in the reference of a name the exercise defines."""
    names = exercise_names(cells[exercise].source)
    for i in range(exercise + 1, len(cells)):
        if is_check_of(cells[i], names):
            return i
    raise ValueError(f"the exercise defining {names} has no check cell after it "
                     f'(a code cell with `NAME = exercises.reference("NAME", globals())`)')


def reveal_cell(solution: str) -> nbformat.NotebookNode:
    reveal = ("<details><summary><b>Reveal the reference solution</b> (try first!)</summary>\n\n"
              f"```python\n{solution}\n```\n</details>")
    return nbformat.v4.new_markdown_cell(reveal, metadata={"tags": ["solution"]})


def student_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    out = copy.deepcopy(nb)
    out.metadata.pop("widgets", None)  # the saved widgets' state belongs to outputs that are cleared below
    reveals = {}  # check cell index -> the reveal cells that go right after it
    for i, cell in enumerate(out.cells):
        if is_exercise(cell):
            check = check_cell_index(out.cells, i)   # before the cut: a name may be defined inside the solution
            cell.source, solution = split_solution(cell.source)
            reveals.setdefault(check, []).append(reveal_cell(solution))
    cells = []
    for i, cell in enumerate(out.cells):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)  # run timestamps: they would change with every run
        cells.append(cell)
        cells.extend(reveals.get(i, []))
    for c in cells:
        c.pop("id", None)
    out.cells = cells
    return out


def reference(name: str, namespace: dict | None = None):
    """The reference solution named ``name`` (a function, class or answer an exercise cell defines), taken from
    the chapter notebooks' exercise cells. ``namespace``: the notebook's globals (its imports)."""
    root = Path(__file__).resolve().parent.parent
    for chapter in chapters(root):
        for cell in nbformat.read(chapter, as_version=4).cells:
            if is_exercise(cell) and name in exercise_names(cell.source):
                scope = dict(namespace or {})
                exec(compile(cell.source, f"{chapter.name} (reference solution)", "exec"), scope)
                return scope[name]
    raise ValueError(f"no exercise defines {name!r}")


def exercise_path(chapter: Path) -> Path:
    return chapter.parent / "exercises" / chapter.name


def render(chapter: Path) -> str:
    nb = nbformat.read(chapter, as_version=4)
    student = student_notebook(nb)
    # stable cell ids so regenerating gives identical files
    for i, cell in enumerate(student.cells):
        cell["id"] = f"cell-{i:03d}"
    return nbformat.writes(student) + "\n"


def chapters(root: Path) -> list[Path]:
    return sorted(p for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def main(argv=None) -> int:
    root = Path(__file__).resolve().parent.parent
    for chapter in chapters(root):
        nb = nbformat.read(chapter, as_version=4)
        if clean_chapter(nb):
            nbformat.write(nb, chapter)
            print(f"cleaned {chapter.relative_to(root)}: saved progress bars removed")
        target = exercise_path(chapter)
        target.parent.mkdir(exist_ok=True)
        target.write_text(render(chapter))
        print(f"wrote {target.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
