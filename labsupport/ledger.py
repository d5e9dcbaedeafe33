"""The decision ledger: what each chapter decided about its technique, from the attendee's own run.

Every chapter judges one technique against a matched control (the KV cache against recomputing, continuous
against static batching, ...) and prints a sentence of figures with their n. A sentence scrolls away; the
wrap-up needs the decisions side by side, as *this* machine reached them. So each chapter ends by recording
one entry here, and chapter 09 shows the ledger (tiny-llm keeps such a record of its tasks).

The decision comes from ``labsupport.measure``'s discipline, never from reading a word:

* **Keep**: the technique beat its control beyond the A/A band (a ``Verdict`` whose ``better`` is True);
* **Reject**: the control beat it beyond the band (``better`` False);
* **Inconclusive**: level, or nothing to read a difference against (one run each, no band).

A ``Verdict`` says which way is better when it was made with ``higher_is_better`` (or ``record`` is told);
anything else is a word plus an explicit ``better=True / False / None``.

One entry per chapter: attendees re-run cells out of order and change parameters (chapter 09's ``k`` is in its
technique's name), so a chapter's record replaces whatever the chapter recorded before.
The entries live in a JSON file, ``$LABSUPPORT_LEDGER``, else ``ledger.json`` in ``$LABSUPPORT_CACHE`` (default
``~/.cache/labsupport``, where the model cache lives), replaced atomically: a kernel killed mid-write leaves the
previous ledger whole. Where the file cannot be written (a read-only or missing home in CI), the chapter still
runs: one warning, and the entry kept in this process's memory.
"""
from __future__ import annotations

import html
import json
import os
import re
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .measure import Verdict

KEEP, REJECT, INCONCLUSIVE = "Keep", "Reject", "Inconclusive"
EMPTY = "No decisions recorded yet — run the chapters: each records its decision at its end."
HEAD = ["ch.", "technique", "control", "decision", "evidence", "recorded (UTC)"]
_UNSET = object()  # ``better`` not given, as distinct from better=None ("neither won")

# Entries whose file could not be written, by ledger file (None: no home to keep one in); shown with the file's.
_unsaved: dict[Path | None, dict[tuple[str, str], "Entry"]] = {}
_warned: set[Path | None] = set()


@dataclass(frozen=True)
class Entry:
    """One chapter's decision about one technique, with the sentence of figures it rests on."""
    chapter: str
    technique: str
    control: str
    decision: str
    evidence: str
    date: str  # when it was recorded, UTC, "YYYY-MM-DD HH:MM"


def decide(verdict: Verdict | str | None, better=_UNSET, higher_is_better: bool | None = None) -> str:
    """Keep, Reject or Inconclusive. A ``Verdict`` decides by its ``better`` (``higher_is_better`` says which way
    is better when the verdict was made without it); a word needs ``better``: True (the technique won beyond the
    noise), False (its control did) or None (neither); None (no verdict could be made) is Inconclusive."""
    if verdict is None:
        if better not in (_UNSET, None):
            raise ValueError(f"no verdict, yet better={better!r}")
        won = None
    elif isinstance(verdict, Verdict):
        if better is not _UNSET:
            raise ValueError("a Verdict decides by itself: pass higher_is_better=, not better=")
        if higher_is_better is not None and verdict.higher_is_better not in (None, higher_is_better):
            raise ValueError(f"the verdict was made with higher_is_better={verdict.higher_is_better}, "
                             f"not {higher_is_better}")
        if verdict.sign == 0:
            won = None
        elif verdict.higher_is_better is not None:
            won = verdict.better
        elif higher_is_better is not None:
            won = (verdict.sign > 0) == higher_is_better
        else:
            raise ValueError(f"the verdict {verdict.word!r} does not say which way is better: "
                             "pass higher_is_better=True or False")
    elif isinstance(verdict, str):
        if better is _UNSET:
            raise ValueError(f"{verdict!r} is a word, not a decision: pass better=True (the technique won), "
                             "False (its control won) or None (neither, or no band to tell)")
        if not (better is True or better is False or better is None):
            raise ValueError(f"better must be True, False or None, not {better!r}")
        if verdict.strip().lower() == "level" and better is not None:
            raise ValueError(f"'level' means neither won, yet better={better}")
        won = better
    else:
        raise ValueError(f"verdict must be a labsupport.measure.Verdict or a word, not {type(verdict).__name__}")
    return INCONCLUSIVE if won is None else KEEP if won else REJECT


def default_path() -> Path:
    """``$LABSUPPORT_LEDGER``, else ``ledger.json`` in ``$LABSUPPORT_CACHE`` or ``~/.cache/labsupport``."""
    if os.environ.get("LABSUPPORT_LEDGER"):
        return Path(os.environ["LABSUPPORT_LEDGER"])
    cache = os.environ.get("LABSUPPORT_CACHE") or Path.home() / ".cache" / "labsupport"
    return Path(cache) / "ledger.json"


def _resolve(path) -> Path | None:
    if path is not None:
        return Path(path)
    try:
        return default_path()
    except RuntimeError:  # no HOME and no password entry: no place for a file, memory only
        return None


def _warn_once(where: Path | None, what: str) -> None:
    if where not in _warned:
        _warned.add(where)
        # the reason without the file's name: a saved notebook's outputs carry no machine paths
        warnings.warn(f"decision ledger: {what}; this session keeps its entries in memory "
                      "(LABSUPPORT_LEDGER names another file)", RuntimeWarning, stacklevel=3)


def _chapter(chapter) -> str:
    text = str(chapter).strip()
    return f"{int(text):02d}" if text.isdigit() else text


def _read(where: Path | None) -> list[Entry]:
    if where is None or not where.exists():
        return []
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
        names = {f.name for f in fields(Entry)}
        return [Entry(**{k: str(item[k]) for k in names}) for item in data["entries"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        _warn_once(where, f"the ledger file could not be read ({type(error).__name__}); it is replaced on the "
                          "next record")
        return []


def _write(where: Path, book: list[Entry]) -> None:
    """The whole ledger to a temporary file beside ``where``, then renamed over it (atomic on one filesystem)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=f".{where.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"schema": 1, "entries": [asdict(e) for e in book]}, f, indent=1, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, where)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _book(where: Path | None) -> dict[tuple[str, str], Entry]:
    book = {(e.chapter, e.technique): e for e in _read(where)}
    book.update(_unsaved.get(where, {}))
    return book


def _in_order(book) -> list[Entry]:
    return sorted(book, key=lambda e: (e.chapter, e.technique))


def record(chapter: str, technique: str, control: str, verdict: Verdict | str | None, evidence: str, better=_UNSET,
           higher_is_better: bool | None = None, path=None) -> Entry:
    """Record (or replace) chapter's decision on ``technique`` against ``control``; ``evidence`` is the sentence
    the chapter printed, figures with their n. ``verdict``, ``better``, ``higher_is_better``: see ``decide``."""
    for name, text in (("technique", technique), ("control", control), ("evidence", evidence)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name} must be a non-empty sentence, not {text!r}")
    entry = Entry(_chapter(chapter), technique.strip(), control.strip(), decide(verdict, better, higher_is_better),
                  " ".join(evidence.split()), time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    where = _resolve(path)
    book = {key: e for key, e in _book(where).items() if e.chapter != entry.chapter}  # a chapter's latest decision
    book[entry.chapter, entry.technique] = entry
    try:
        if where is None:
            raise OSError("no home directory to keep the ledger file in")
        _write(where, _in_order(book.values()))
        _unsaved.pop(where, None)  # the file now holds what memory held
    except OSError as error:
        _warn_once(where, f"the ledger file could not be written ({error.strerror or error})")
        _unsaved.setdefault(where, {})[entry.chapter, entry.technique] = entry
    return entry


def entries(path=None) -> list[Entry]:
    """Every recorded decision, by chapter (then technique)."""
    return _in_order(_book(_resolve(path)).values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


class Ledger:
    """The ledger as a table: HTML in a notebook, markdown as text (a deck embeds the markdown)."""

    def __init__(self, rows: list[Entry]):
        self.rows = rows

    def cells(self) -> list[list[str]]:
        return [[e.chapter, e.technique, e.control, e.decision, e.evidence, e.date] for e in self.rows]

    def markdown(self) -> str:
        if not self.rows:
            return EMPTY
        lines = [HEAD, ["---"] * len(HEAD), *([c if i != 3 else f"**{c}**" for i, c in enumerate(row)]
                                              for row in self.cells())]
        return "\n".join("| " + " | ".join(_cell(c) for c in line) + " |" for line in lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>{html.escape(EMPTY)}</p>"
        shade = {KEEP: "#dff3e3", REJECT: "#fbe0e0", INCONCLUSIVE: "#eef0f2"}
        body = "".join(f'<tr style="background:{shade.get(row[3], "")}">'
                       + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.cells())
        heads = "".join(f"<th>{html.escape(h)}</th>" for h in HEAD)
        return f"<table><thead><tr>{heads}</tr></thead><tbody>{body}</tbody></table>"

    def _repr_markdown_(self) -> str:
        return self.markdown()

    __str__ = __repr__ = _repr_markdown_  # text/plain too: what a terminal shows


def show(path=None) -> Ledger:
    """The ledger, for ``display``: every chapter's technique, control, decision and evidence, by chapter."""
    return Ledger(entries(path))


def from_markdown(text: str) -> list[Entry]:
    """The entries of a table ``Ledger.markdown`` wrote (chapter 09's saved output), the inverse of ``markdown``."""
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != len(HEAD):
            raise ValueError(f"not a ledger row ({len(cells)} cells, not {len(HEAD)}): {line[:80]!r}")
        if cells == HEAD or set("".join(cells)) <= {"-"}:
            continue  # the heading and its rule
        chapter, technique, control, decision, evidence, date = cells
        rows.append(Entry(chapter, technique, control, decision.strip("*"), evidence, date))
    return rows


def restore(notebook, path=None) -> list[Entry]:
    """Replace the ledger file with the table a saved notebook shows (its ``ledger.show()`` output). For a developer
    who executes one chapter again: restored from the committed chapter 09 first, the ledger holds the committed
    chapters' decisions, and the chapter executed replaces only its own row."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    shown = [out["data"]["text/markdown"] for cell in cells for out in cell.get("outputs", [])
             if "ledger.show()" in "".join(cell.get("source", [])) and "text/markdown" in out.get("data", {})]
    if len(shown) != 1:
        raise ValueError(f"{notebook}: expected one saved ledger.show() output, found {len(shown)}")
    text = "".join(shown[0]) if isinstance(shown[0], list) else shown[0]
    rows = [] if text.strip() == EMPTY else from_markdown(text)
    where = _resolve(path)
    if where is None:
        raise OSError("no home directory to keep the ledger file in")
    _write(where, _in_order(rows))
    _unsaved.pop(where, None)
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labsupport.ledger",
                                     description="Restore the decision ledger from a saved notebook's table.")
    parser.add_argument("notebook", help="a saved notebook that shows the ledger (chapter 09)")
    parser.add_argument("--path", help="the ledger file (default: $LABSUPPORT_LEDGER or the cache's ledger.json)")
    args = parser.parse_args()
    restored = restore(args.notebook, args.path)
    print(f"{len(restored)} entries restored to {_resolve(args.path)}: chapters {', '.join(e.chapter for e in restored)}")
