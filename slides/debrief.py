"""Two decks from one file: the presenting deck, which never shows an exercise's answer, and the instructor deck.

A slide whose own line reads ``<!-- debrief -->`` holds a solution: code of a ``# BEGIN SOLUTION`` block, or
the rule, formula or step list that the solution implements. Shown before the exercise time it gives the
exercise away, so

* the presenting build (``python slides/build.py``, ``make slides``) drops every debrief slide;
* the instructor build (``--instructor``, ``make slides-instructor``) keeps them, without the marker line
  (Marp would show it as a presenter note).

Debrief slides form one section at the **end** of a deck, after the exercise time: an instructor presents
the deck, the room does the exercises, then the debrief section walks through the answers. A debrief slide
followed by an ordinary one is an error, so an answer cannot creep back mid-deck by being marked and moved
up; ``tests/test_slides.py`` checks the presenting decks against every chapter's solution blocks.
"""
from __future__ import annotations

import re

MARKER = re.compile(r"^<!--\s*debrief\s*-->[ \t]*$", re.MULTILINE)
FENCE = re.compile(r"^\s*(```|~~~)")


def split_slides(markdown: str) -> tuple[str, list[str]]:
    """(front matter with its closing ``---``, the slides); slide breaks are ``---`` lines outside code fences."""
    lines = markdown.splitlines(keepends=True)
    head_end = 0
    if lines and lines[0].strip() == "---":   # Marp's front matter: ---, the directives, ---
        head_end = next((i + 1 for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
    slides, current, fence = [], [], None
    for line in lines[head_end:]:
        marker = FENCE.match(line)
        if marker and (fence is None or marker.group(1) == fence):
            fence = marker.group(1) if fence is None else None
        if fence is None and line.rstrip("\r\n") == "---":
            slides.append("".join(current))
            current = []
        else:
            current.append(line)
    slides.append("".join(current))
    return "".join(lines[:head_end]), slides


def is_debrief(slide: str) -> bool:
    return MARKER.search(slide) is not None


def select(markdown: str, instructor: bool) -> str:
    """The deck for presenting (debrief slides dropped) or for the instructor (kept, marker lines removed).

    ValueError when a debrief slide comes before an ordinary one: the debrief is the deck's last section.
    """
    head, slides = split_slides(markdown)
    kinds = [is_debrief(s) for s in slides]
    first = kinds.index(True) if True in kinds else len(slides)
    if not all(kinds[first:]):
        late = next(i for i in range(first, len(slides)) if not kinds[i])
        raise ValueError(f"slide {first + 1} is marked <!-- debrief --> but slide {late + 1} after it is not: "
                         "debrief slides (the exercises' answers) form the deck's last section")
    kept = [MARKER.sub("", s) for s in slides] if instructor else slides[:first]
    return head + "---\n".join(kept)
