"""The claim check: every figure the prose of a chapter states is one its own run printed.

    python -m labsupport.claims [FILE ...]     (default: notebooks/NN_*.ipynb and slides/NN_*.md)

A chapter ``NN`` is its notebook ``notebooks/NN_*.ipynb`` and its deck ``slides/NN_*.md``. The check
reads the prose of both — the notebook's markdown cells, the deck's text with its presenter notes
(HTML comments) — and finds every **figure**: a number with a unit. Each must be shown by the
chapter's **outputs**: the stream, ``text/plain`` and ``text/markdown`` outputs of the notebook's code
cells, and the saved JSON data the chapter declares. A figure no output shows is reported with its
file, deck line or notebook cell index, and the exit status is 1.

The rules, exactly:

* **Figures.** A number (``1,265``, ``0.5``; signs ignored) followed by a unit: ``µs ms s min``
  (and ``seconds``, ``minutes``, ``hours``), ``tok/s tokens/s req/s``, ``%``, a ratio ``3.2x`` or
  ``3.2×`` (written against the number: ``2 x 30`` is a product), ``bytes KB KiB MB MiB GB GiB TB``,
  ``MB/s GB/s TB/s``, ``GFLOP/s TFLOP/s``, or a ``$`` before it. In ``60-80 %``, ``1,212 → 1,192 ms``,
  ``67.8/82.5 tok/s`` and ``96.7 vs 96.5 tok/s`` every number takes the unit. In a table, a bare number
  takes the unit its column's header names (``| TTFT P50 (ms) |``). A number inside a word
  (``SmolLM2-135M``, ``P99``, ``Llama-3-8B``) or without a unit is not a figure.
* **Not prose.** Inline code and fenced code, display maths (``$$ … $$``), a deck's front matter,
  ``<style>`` blocks, tags, image and link targets.
* **Sentences.** Blank lines, headings, list items, table cells and HTML comments start new
  sentences, and so does ``.``, ``!`` or ``?`` followed by a space and a capital letter (so ``e.g. a``
  does not). A sentence runs to the start of the next one, so a comment right after it (on the same
  line or the next) belongs to it.
* **Exempt.** A sentence holding ``<!-- cite: SOURCE -->`` (a figure from a paper or a vendor) or
  ``<!-- constant: WHY -->`` (a figure the course chooses, not measures: a budget, a target, a price,
  the time a reader needs); and the figures of ``CONSTANTS`` below, where the sentence names their
  hardware.
* **Within its rounding.** A figure written with ``d`` decimals is shown by an output that, in the
  figure's unit, lies within half a unit of its last digit: a prose ``1.5 s`` is shown by ``1.46 s``
  or ``1,460 ms``, not by ``1.4 s``; ``77 %`` by ``77.3%`` or a fraction ``0.773``. Units convert
  within their kind (``s``↔``ms``↔``min``, ``MB``↔``GiB``, ``%``↔fraction). An output number takes
  the unit written after it, else the one its markdown table column names (``| TTFT P50 ms |``), else
  a ``(unit)`` label before it on its line (``TTFT (ms) mean/P50  1800.0 / 2022.7``); a bare number
  with none of these shows only a ratio (``1.42`` for ``1.42×``) or a percentage as a fraction.
* **Hedged.** After ``about``, ``around``, ``roughly``, ``nearly``, ``almost``, ``some``, ``~`` or
  ``≈`` the figure may be 10 % off (or its rounding, if wider).
* **Bounds.** After ``under``, ``below``, ``less than``, ``at most``, ``up to``, ``within``, ``<``,
  ``≤`` (or ``over``, ``above``, ``more than``, ``at least``, ``>``, ``≥``) the figure is a bound: an
  output in the same unit on the right side of it shows it, and so does its value (``TTFT ≤ 2 s``
  beside an output ``TTFT <= 2000 ms``).
* **Saved data.** ``<!-- data: PATH -->`` (PATH from the repository root) in a markdown cell or the
  deck adds a JSON file's numbers to the chapter's outputs; a key ending in ``_ms``, ``_s``,
  ``seconds``, ``tok_s`` or ``req_s`` gives its number that unit, one starting with ``usd`` dollars,
  any other number has none.

A figure that no output shows is either a measurement to print from the cell that measured it
(``display(Markdown(f"..."))``), a number the run no longer supports, or a citation to mark.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# unit spelling -> (kind, factor to the kind's base unit)
UNITS = {
    "µs": ("time", 1e-6), "us": ("time", 1e-6), "ms": ("time", 1e-3), "s": ("time", 1.0),
    "sec": ("time", 1.0), "second": ("time", 1.0), "seconds": ("time", 1.0),
    "min": ("time", 60.0), "minute": ("time", 60.0), "minutes": ("time", 60.0),
    "hour": ("time", 3600.0), "hours": ("time", 3600.0),
    "tok/s": ("tok/s", 1.0), "tokens/s": ("tok/s", 1.0), "token/s": ("tok/s", 1.0),
    "output tokens/s": ("tok/s", 1.0), "req/s": ("req/s", 1.0), "requests/s": ("req/s", 1.0),
    "%": ("ratio", 0.01), "x": ("times", 1.0), "×": ("times", 1.0),
    "bytes": ("bytes", 1.0), "KB": ("bytes", 1e3), "KiB": ("bytes", 2.0**10), "MB": ("bytes", 1e6),
    "MiB": ("bytes", 2.0**20), "GB": ("bytes", 1e9), "GiB": ("bytes", 2.0**30), "TB": ("bytes", 1e12),
    "MB/s": ("bytes/s", 1e6), "GB/s": ("bytes/s", 1e9), "GiB/s": ("bytes/s", 2.0**30), "TB/s": ("bytes/s", 1e12),
    "GFLOP/s": ("flop/s", 1e9), "TFLOP/s": ("flop/s", 1e12), "$": ("usd", 1.0),
}
# Figures every chapter may state without a run: (a word the sentence must hold, figure, unit, source).
CONSTANTS = [
    ("H200", 4.8, "TB/s", "NVIDIA H200 datasheet: 4.8 TB/s of HBM3e"),
    ("H200", 141, "GB", "NVIDIA H200 datasheet: 141 GB of HBM3e"),
    ("80 GiB", 80, "GiB", "an A100/H100 80 GB card, as nvidia-smi reports it"),
    ("H100", 3.35, "TB/s", "NVIDIA H100 SXM datasheet: 3.35 TB/s of HBM3"),
]

NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
UNIT = (r"(?:\s?(?:" + "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True)
                                  if u not in ("x", "×", "$", "%")) + r")(?![\w/])|\s?%|[x×](?![\w(]))")
LINK = r"\s*(?:[-–—/→]|->|to|vs\.?)\s*"
# a chain of numbers joined by links, with a unit after the last ("20–38 %"), or a dollar amount
FIGURE = re.compile(rf"(?<![\w.,$])(?<!\w[-.])(?P<chain>{NUMBER}(?:{LINK}{NUMBER})*)(?P<unit>{UNIT})?(?![\w])"
                    rf"|\$(?P<usd>{NUMBER})(?![\w])")
ONE_NUMBER = re.compile(NUMBER)
HEDGE = re.compile(r"(?:\babout|\baround|\broughly|\bnearly|\balmost|\bsome|~|≈|\bapprox(?:imately|\.)?)\s*$", re.I)
UPPER = re.compile(r"(?:\bunder|\bbelow|\bless than|\bfewer than|\bat most|\bup to|\bwithin|<|≤|<=)\s*$", re.I)
LOWER = re.compile(r"(?:\bover|\babove|\bmore than|\bat least|\bexceeds?|>|≥|>=)\s*$", re.I)
MARK = re.compile(r"<!--\s*(cite|constant):.*?-->", re.S)
DATA = re.compile(r"<!--\s*data:\s*(\S+)\s*-->")
SENTENCE_START = re.compile(r"\n\s*\n|\n\s*(?:[-*+]\s|\d+\.\s|#|\|)|\||<!--|-->|(?<=[.!?])\s+(?=[*_(\"']*[A-Z])")
JSON_UNITS = [("tok_s", "tok/s"), ("req_s", "req/s"), ("_ms", "ms"), ("seconds", "s"), ("_s", "s")]


@dataclass
class Figure:
    text: str        # as written, for the report
    value: float
    unit: str
    decimals: int
    kind: str        # "exact", "hedged", "upper" or "lower"
    line: int        # line in the text it came from (1-based)
    written: str = ""  # the whole chain as written ("1,212 → 1,192 ms")


@dataclass
class Shown:
    value: float
    unit: str | None


def parse_number(text: str) -> tuple[float, int]:
    digits = text.replace(",", "")
    return float(digits), len(digits.split(".")[1]) if "." in digits else 0


def normal_unit(raw: str | None) -> str | None:
    return raw.strip() if raw else None


# --- prose ----------------------------------------------------------------------------------------

def blank(text: str, pattern: str, flags=0) -> str:
    """Replace what ``pattern`` matches by spaces (newlines kept, so lines still count)."""
    return re.sub(pattern, lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=flags)


def prose(markdown: str, deck: bool = False) -> str:
    """The markdown with everything that is not prose blanked out, line for line."""
    if deck:
        markdown = blank(markdown, r"\A---\n.*?\n---\n", re.S)                  # front matter
    markdown = blank(markdown, r"^(\s*)(```|~~~).*?^\s*\2[^\n]*$", re.S | re.M)  # fenced code
    markdown = blank(markdown, r"<style\b.*?</style>", re.S | re.I)
    markdown = blank(markdown, r"\$\$.*?\$\$", re.S)                               # display maths
    markdown = blank(markdown, r"`[^`\n]*`")                                      # inline code
    markdown = blank(markdown, r"!\[[^\]]*\]\([^)]*\)")                             # images, Marp's "bg right:45%" too
    markdown = blank(markdown, r"\]\([^)\s]*(?:\s+\"[^\"]*\")?\)")                # link targets
    markdown = blank(markdown, r"<(?!!--)/?[A-Za-z][^>]*>")                       # tags, not comments
    return markdown.replace("**", "  ").replace("__", "  ")


def table_units(text: str) -> dict[tuple[int, int], str]:
    """(line, column) -> the unit its table header names (its last word: ``TTFT P50 (ms)``), per body cell."""
    units, header = {}, None
    for number, line in enumerate(text.split("\n"), 1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = line.strip().strip("|").split("|")
        if header is None:
            header = [next((w for w in reversed(re.split(r"[\s()]+", c)) if w in UNITS), None) for c in cells]
        elif not re.fullmatch(r"[\s|:-]+", line):
            units.update({(number, col): unit for col, unit in enumerate(header) if unit})
    return units


def column_unit(text: str, at: int, columns: dict) -> str | None:
    """The unit the table header names for a bare number at ``at``, if it stands in such a column."""
    before = text[text.rfind("\n", 0, at) + 1:at]
    if not before.lstrip().startswith("|"):
        return None
    return columns.get((text.count("\n", 0, at) + 1, before.count("|") - 1))


def figures(markdown: str, deck: bool = False) -> list[Figure]:
    """Every figure of the prose not exempt by a marker or a constant."""
    text = prose(markdown, deck)
    marked = [m.start() for m in MARK.finditer(text)]
    text = blank(text, MARK.pattern, re.S)
    starts = [0] + [m.end() for m in SENTENCE_START.finditer(text)] + [len(text)]  # the space between: the one before
    columns = table_units(text)
    found = []
    for m in FIGURE.finditer(text):
        at = m.start()
        i = bisect.bisect_right(starts, at) - 1
        sentence_start, sentence_end = starts[i], starts[min(i + 1, len(starts) - 1)]
        if any(sentence_start <= p < sentence_end for p in marked):
            continue
        sentence = text[sentence_start:sentence_end]
        line = text.count("\n", 0, at) + 1
        unit = "$" if m.group("usd") else normal_unit(m.group("unit"))
        unit = unit or column_unit(text, at, columns)  # a bare number is a figure only under a unit's column
        if unit is None:
            continue
        before = text[max(sentence_start, at - 20):at].replace("*", " ")
        kind = ("hedged" if HEDGE.search(before) else "upper" if UPPER.search(before)
                else "lower" if LOWER.search(before) else "exact")
        for number in ONE_NUMBER.findall(m.group("usd") or m.group("chain")):
            value, decimals = parse_number(number)
            if any(word in sentence and value == v and unit == u for word, v, u, _ in CONSTANTS):
                continue
            found.append(Figure(f"${number}" if unit == "$" else f"{number}{unit}" if unit in "x×" else f"{number} {unit}",
                                value, unit, decimals, kind, line, re.sub(r"\s+", " ", m.group(0).strip())))
    return found


# --- outputs --------------------------------------------------------------------------------------

def shown_in(text: str) -> list[Shown]:
    """Every number of an output text, with its unit where one follows it or its table column names one."""
    columns, out = table_units(text), []
    for m in FIGURE.finditer(text):
        unit = "$" if m.group("usd") else normal_unit(m.group("unit"))
        if unit is None:  # a bare number: the unit its table column names, or a label before it, "TTFT (ms) 912"
            label = re.findall(r"\(([^()\s]+)\)", text[text.rfind("\n", 0, m.start()) + 1:m.start()])
            unit = column_unit(text, m.start(), columns) or (label[-1] if label and label[-1] in UNITS else None)
        out += [Shown(parse_number(n)[0], unit) for n in ONE_NUMBER.findall(m.group("usd") or m.group("chain"))]
    return out


def shown_in_json(data, key: str = "") -> list[Shown]:
    if isinstance(data, dict):
        return [s for k, v in data.items() for s in shown_in_json(v, k)]
    if isinstance(data, list):
        return [s for v in data for s in shown_in_json(v, key)]
    if isinstance(data, bool) or data is None:
        return []
    if isinstance(data, (int, float)):
        unit = "$" if key.startswith("usd") else next((u for suffix, u in JSON_UNITS if key.endswith(suffix)), None)
        return [Shown(float(data), unit)] if math.isfinite(data) else []
    return shown_in(str(data))


def output_text(cell) -> str:
    texts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            texts.append(output.get("text", ""))
        for mime in ("text/plain", "text/markdown"):
            texts.append(output.get("data", {}).get(mime, ""))
    return "\n".join("".join(t) if isinstance(t, list) else t for t in texts)


def supports(shown: Shown, fig: Figure) -> bool:
    kind, factor = UNITS[fig.unit]
    half = 0.5 * 10.0 ** -fig.decimals
    tolerance = max(half, 0.1 * fig.value) if fig.kind == "hedged" else half
    if fig.kind in ("upper", "lower") and shown.unit is not None and UNITS[shown.unit] == UNITS[fig.unit]:
        if shown.value <= fig.value + half if fig.kind == "upper" else shown.value >= fig.value - half:
            return True  # a bound: an output in the same unit on its side (else, as any figure, its value)
    if shown.unit is None:  # a bare number shows a ratio, or a percentage as a fraction
        candidates = [shown.value] if kind == "times" else [100 * shown.value] if fig.unit == "%" else []
    elif UNITS[shown.unit][0] == kind:
        candidates = [shown.value * UNITS[shown.unit][1] / factor]
    else:
        return False
    return any(abs(c - fig.value) <= tolerance * (1 + 1e-9) + 1e-12 for c in candidates)


# --- chapters -------------------------------------------------------------------------------------

@dataclass
class Failure:
    path: Path
    where: str       # "line 12" (deck) or "cell 6" (notebook)
    figure: Figure

    def __str__(self):
        f = self.figure
        how = {"exact": "", "hedged": "about ", "upper": "at most ", "lower": "at least "}[f.kind]
        written = f" (in \"{f.written}\")" if f.written and f.written != f.text else ""
        return f"{self.path}: {self.where}: {how}{f.text}{written} is in none of the chapter's outputs"


def read_notebook(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def chapter_outputs(root: Path, chapter: str, extra_markdown: list[str]) -> list[Shown]:
    """What chapter ``chapter``'s notebook printed, and the numbers of the data files it or its deck declares."""
    shown, declared = [], list(extra_markdown)
    for nb_path in sorted((root / "notebooks").glob(f"{chapter}_*.ipynb")):
        nb = read_notebook(nb_path)
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                shown += shown_in(output_text(cell))
            elif cell["cell_type"] == "markdown":
                declared.append(source(cell))
    for path in sorted({p for text in declared for p in DATA.findall(text)}):
        shown += shown_in_json(json.loads((root / path).read_text(encoding="utf-8")))
    return shown


def check_file(path: Path, root: Path) -> list[Failure]:
    """The figures of one notebook or deck that none of its chapter's outputs shows."""
    chapter = path.name[:2]
    if path.suffix == ".ipynb":
        nb = read_notebook(path)
        parts = [(f"cell {i}", source(c), False) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"]
        shown = chapter_outputs(root, chapter, [source(c) for c in nb["cells"] if c["cell_type"] == "markdown"])
        shown += [s for c in nb["cells"] if c["cell_type"] == "code" for s in shown_in(output_text(c))]
    else:
        deck = path.read_text(encoding="utf-8")
        parts = [("line", deck, True)]
        shown = chapter_outputs(root, chapter, [deck])
    failures = []
    for where, text, is_deck in parts:
        for fig in figures(text, deck=is_deck):
            if not any(supports(s, fig) for s in shown):
                failures.append(Failure(path, f"line {fig.line}" if where == "line" else f"{where}, line {fig.line}", fig))
    return failures


def default_files(root: Path) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((root / "slides").glob("[0-9][0-9]_*.md"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Every figure in a chapter's prose must be in its outputs.")
    parser.add_argument("files", nargs="*", type=Path, help="notebooks and decks (default: every chapter's)")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    args = parser.parse_args(argv)
    files = args.files or default_files(args.root)
    failures = [f for path in files for f in check_file(path, args.root)]
    for failure in failures:
        print(failure)
    print(f"claims: {len(files)} files, {len(failures)} figures not shown by their chapter's outputs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
