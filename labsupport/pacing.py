"""How long a chapter takes an attendee, sized from its cells, and the budgets that keep it readable.

Every chapter's opening cell says **Time:** about T minutes (R to read and run, E for the exercises), and the
README's table says the same. Those figures are not guesses: this module computes them from the notebook, and
``tests/test_pacing.py`` fails when a header or the README says something else, or a cell breaks a budget.

The rule, stated once:

* **Reading and running**: the prose an attendee sees (markdown outside ``<details>`` hints and HTML comments)
  at ``READING_WPM`` words a minute, slower than the 200-250 of plain prose because these cells hold tables,
  figures and arithmetic; plus ``SECONDS_PER_CODE_CELL`` for each code cell (read it, run it, read what it
  printed). The chapter's own run time is inside that: the course holds it to 3 minutes on a 2-core CPU.
* **Exercises**, by kind, from the heading above each exercise cell: a heading that starts "Warm-up:" (the text
  gives the steps, the attendee writes them; ``tests/test_exercises.py`` holds warm-ups to that label)
  ``WARM_UP`` minutes; one with the word "hard" (a design the check judges against planted mistakes)
  ``HARD``; any other exercise ``EXERCISE``. Hints and reveals are collapsed, so they are not counted as
  reading; an exercise's code cell counts its 20 seconds of reading too (the attendee reads the stub).
* Each part is rounded up to 5 minutes.

The budgets, against walls of text and cells that bury their measurement in formatting:

* a markdown cell shows at most ``WORDS_PER_CELL`` words (the opening cell, which holds the title, the time,
  the motivation and the learning goals, ``OPENING_WORDS``);
* a code cell that is not an exercise holds at most ``LINES_PER_CELL`` lines: sentence formatting belongs in
  the helpers, so the cell shows its measurement;
* a chapter holds at most ``WORDS_PER_CHAPTER`` words of visible prose.

``python -m labsupport.pacing`` prints each chapter's figures; ``--check`` exits 1 where a header, the README
or a budget disagrees; ``--write`` rewrites the headers' and the README's times from the rule.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

READING_WPM = 180
SECONDS_PER_CODE_CELL = 20
WARM_UP, EXERCISE, HARD = 10, 15, 25
WORDS_PER_CELL, OPENING_WORDS, WORDS_PER_CHAPTER = 500, 550, 7500
LINES_PER_CELL = 60

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = re.compile(r"<!--.*?-->|<details>.*?</details>", re.S)
HEADING = re.compile(r"^#+\s*(?:\d+[a-z]?\.\s*)?(.*)$")
# "**Time:** about 60 minutes (35 to read and run, 25 for the hard exercise)." in the opening cell
HEADER_TIME = re.compile(r"\*\*Time:\*\* about (\d+) minutes \((\d+) to read and run(?:, (\d+) for )?")
# "| 35 min: 20 reading and running, 15 exercises (its last run ..." in the README's chapter table
README_TIME = re.compile(r"\| (\d+) min: (\d+) reading and running(?:, (\d+) exercises?)? ")


def up5(minutes: float) -> int:
    return 5 * math.ceil(minutes / 5 - 1e-9)


def visible_words(markdown: str) -> int:
    return len(HIDDEN.sub(" ", markdown).split())


def exercise_kind(heading: str | None) -> str:
    heading = (heading or "").lower()
    return "warm-up" if heading.startswith("warm-up") else "hard" if re.search(r"\bhard\b", heading) else "exercise"


def headings(markdown: str) -> list[str]:
    """The markdown headings of a cell, not counting ``#`` lines inside code fences or collapsed hints."""
    shown = re.sub(r"```.*?```", " ", HIDDEN.sub(" ", markdown), flags=re.S)
    return [HEADING.match(line).group(1) for line in shown.splitlines() if line.startswith("#")]


MINUTES = {"warm-up": WARM_UP, "exercise": EXERCISE, "hard": HARD}


@dataclasses.dataclass
class Pace:
    chapter: str
    words: int
    code_cells: int
    exercises: list[tuple[str, str]]           # (heading, kind)
    walls: list[tuple[int, int]]               # (cell index, visible words) over budget
    long_cells: list[tuple[int, int]]          # (cell index, lines) over budget

    @property
    def reading_min(self) -> int:
        return up5(self.words / READING_WPM + self.code_cells * SECONDS_PER_CODE_CELL / 60)

    @property
    def exercise_min(self) -> int:
        return up5(sum(MINUTES[kind] for _, kind in self.exercises))

    @property
    def total_min(self) -> int:
        return self.reading_min + self.exercise_min

    def breakdown(self) -> str:
        """The exercises by kind: "a warm-up (10) and the hard exercise (25)"."""
        counts = {kind: sum(k == kind for _, k in self.exercises) for kind in MINUTES}
        names = {"warm-up": ("a warm-up", "warm-ups"), "exercise": ("an exercise", "exercises"),
                 "hard": ("the hard exercise", "hard exercises")}
        parts = [(names[k][0] if n == 1 else f"{n} {names[k][1]}") + f" ({MINUTES[k]} each)" * (n > 1)
                 + f" ({MINUTES[k]})" * (n == 1) for k, n in counts.items() if n]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]

    def header_time(self) -> str:
        if not self.exercises:
            return f"**Time:** about {self.total_min} minutes ({self.reading_min} to read and run)."
        if len(self.exercises) == 1:
            name = {"warm-up": "the warm-up", "exercise": "the exercise", "hard": "the hard exercise"}
            what = name[self.exercises[0][1]]
        else:
            what = f"the exercises: {self.breakdown()}"
        return f"**Time:** about {self.total_min} minutes ({self.reading_min} to read and run, {self.exercise_min} for {what})."

    def readme_time(self) -> str:
        if not self.exercises:
            return f"| {self.total_min} min: {self.reading_min} reading and running "
        return f"| {self.total_min} min: {self.reading_min} reading and running, {self.exercise_min} exercises "

    def budget_problems(self) -> list[str]:
        out = [f"{self.chapter}: cell {i} shows {w} words (budget {OPENING_WORDS if i == 0 else WORDS_PER_CELL}): "
               "split it where the idea changes" for i, w in self.walls]
        out += [f"{self.chapter}: code cell {i} holds {n} lines (budget {LINES_PER_CELL}): move the sentence "
                "formatting into a helper" for i, n in self.long_cells]
        if self.words > WORDS_PER_CHAPTER:
            out.append(f"{self.chapter}: {self.words} words of prose (budget {WORDS_PER_CHAPTER})")
        return out


def pace(path: Path) -> Pace:
    cells = json.loads(Path(path).read_text())["cells"]
    words = code = 0
    exercises, walls, long_cells, heading = [], [], [], None
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            n = visible_words(source)
            words += n
            if n > (OPENING_WORDS if i == 0 else WORDS_PER_CELL):
                walls.append((i, n))
            heading = (headings(source) or [heading])[-1]
        elif cell["cell_type"] == "code":
            code += 1
            if "exercise" in cell.get("metadata", {}).get("tags", []):
                exercises.append((heading, exercise_kind(heading)))
            elif len(source.splitlines()) > LINES_PER_CELL:
                long_cells.append((i, len(source.splitlines())))
    return Pace(Path(path).stem, words, code, exercises, walls, long_cells)


def chapters(root: Path = ROOT) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def stated(path: Path, readme: str) -> dict[str, tuple]:
    """What the chapter's header and the README's row say: (total, reading, exercises), None where absent."""
    opening = "".join(json.loads(Path(path).read_text())["cells"][0]["source"])
    header = HEADER_TIME.search(opening)
    row = next((line for line in readme.splitlines() if f"notebooks/{path.name})" in line), "")
    table = README_TIME.search(row)
    as_ints = (lambda m: tuple(int(g) if g else 0 for g in m.groups()) if m else None)
    return {"header": as_ints(header), "README": as_ints(table)}


def problems(root: Path = ROOT) -> list[str]:
    readme = (root / "README.md").read_text()
    out = []
    for path in chapters(root):
        p = pace(path)
        want = (p.total_min, p.reading_min, p.exercise_min)
        for where, got in stated(path, readme).items():
            if got != want:
                out.append(f"{p.chapter}: the {where} states {got} (total, reading and running, exercises) minutes; "
                           f"the rule gives {want}")
        out += p.budget_problems()
    return out


def write(root: Path = ROOT) -> None:
    """Rewrite each header's **Time:** sentence and the README's time column from the rule."""
    readme_path = root / "README.md"
    readme = readme_path.read_text()
    for path in chapters(root):
        p = pace(path)
        nb = json.loads(path.read_text())
        opening = "".join(nb["cells"][0]["source"])
        new = re.sub(r"\*\*Time:\*\* about \d+ minutes(?: \([^)]*(?:\([^)]*\)[^)]*)*\))?\.", p.header_time(),
                     opening, count=1)
        if new != opening:
            nb["cells"][0]["source"] = new.splitlines(True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        readme = "\n".join(
            re.sub(r"\| \d+ min(?::[^(|]*)? (?=\(its last run)", p.readme_time(), line)
            if f"notebooks/{path.name})" in line else line for line in readme.splitlines()) + "\n"
    readme_path.write_text(readme)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--write" in argv:
        write()
    for path in chapters():
        p = pace(path)
        print(f"{p.chapter:28s} {p.words:5d} words, {p.code_cells:2d} code cells -> {p.reading_min:3d} min reading and "
              f"running; {len(p.exercises)} exercises -> {p.exercise_min:3d} min; total {p.total_min:3d} min")
    if "--check" in argv:
        found = problems()
        print("\n".join(found) or "every header and README row states the rule's time; every cell within budget")
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
