"""The course map: one slide, drawn from one table, opening every deck with its chapter highlighted.

A deck asks for it with a line ``<!-- course-map -->`` (``build.py`` expands it before Marp runs),
so the map is written once here and cannot drift between decks. It is the first seed's picture:
the wastes a serving engine removes, and the request path each chapter works on. The same path, every
chapter placed on its stations (``pipeline_table``), opens chapter 00 and the wrap-up deck; a test holds
chapter 00's copy to this one.
"""
from __future__ import annotations

import re

DIRECTIVE = re.compile(r"^<!--\s*course-map\s*-->[ \t]*$", re.MULTILINE)

# The request path, in the order a request meets it; each chapter names the stations it changes.
# The first article's pipeline: gateway/router -> cache -> prefill -> KV transfer -> decode, with batching
# (the scheduler) deciding what runs in each step.
PATH = ["request", "router", "result cache", "prefix cache", "scheduler", "prefill", "KV transfer", "KV blocks",
        "decode", "answer"]

CHAPTERS = {
    "00": ("from model to API", ["request", "prefill", "decode", "answer"]),
    "01": ("KV cache", ["prefill", "KV blocks", "decode"]),
    "02": ("PagedAttention", ["KV blocks"]),
    "03": ("multi-level cache", ["result cache", "prefix cache", "KV blocks"]),
    "04": ("continuous batching", ["scheduler", "decode"]),
    "05": ("chunked prefill", ["scheduler", "prefill"]),
    "06": ("serving", ["request", "answer"]),
    "07": ("PD disaggregation", ["router", "prefill", "KV transfer", "KV blocks", "decode"]),
    "08": ("the same in vLLM", PATH),
    "09": ("compute less", ["prefill", "decode"]),
    "10": ("wrap-up: the whole course", PATH),  # the last deck; no chapter of its own to highlight
}

# The seeds' pictures, where one teaches: a clinic for scheduling, a restaurant for prefill and decode.
PICTURES = {
    "00": "prefill reads the question, decode writes the answer, one word at a time",
    "01": "a reader who remembers what was said instead of rereading it for every word",
    "04": "a clinic calls the next patient as soon as a room is free, not when the morning's batch is done",
    "05": "the clinic sees the quick check-ups between the long appointments instead of after them",
    "07": "a restaurant: one crew preps (reads the question), another cooks to order (writes the answer)",
}

# (the waste, what removes it, the chapters that do it)
WASTES = [
    ("repeated computation", "keep past tokens' KV; reuse shared prefixes, whole answers and one prompt's KV for "
     "n samples", ["01", "03"]),
    ("an idle accelerator", "batch decodes, refill a slot the step it frees", ["04"]),
    ("prefill/decode interference", "a long prompt's step stalls every decoding user: chunk it beside the decodes, "
     "or give prefill and decode their own workers", ["05", "07"]),
    ("memory", "count KV bytes, page the cache into blocks, spill to a CPU tier", ["01", "02", "03"]),
    ("and then", "serve it for real, run the same in vLLM, compute less", ["00", "06", "08", "09"]),
]


def _chapter(nn: str, here: str) -> str:
    label = f"{nn} {CHAPTERS[nn][0]}"
    return f"<mark>**{label}**</mark>" if nn == here else label


def course_map(here: str) -> str:
    """The map slide's markdown, chapter ``here`` ("00".."09") highlighted ("10", the wrap-up: the whole path)."""
    if here not in CHAPTERS:
        raise ValueError(f"no chapter {here!r} on the course map")
    touched = set(CHAPTERS[here][1])
    path = " → ".join(f"**{s}**" if s in touched else s for s in PATH)
    rows = "\n".join(f"| {waste} | {how} | {' · '.join(_chapter(nn, here) for nn in chapters)} |"
                     for waste, how, chapters in WASTES)
    return (f"<!-- _class: dense -->\n\n<style scoped>\ntable {{ font-size: 17px; }}\n"
            f".caption {{ font-size: 17px; }}\nh2 {{ margin-bottom: 4px; }}\n</style>\n\n"
            + (f"## Where chapter {here} sits: {CHAPTERS[here][0]}\n\n" if here != "10" else
               "## The course map: every station of the path, every chapter\n\n")
            + f"<div class=\"caption\">\n\n{path}\n\n</div>\n\n"
            f"| the waste | what removes it | chapters |\n|---|---|---|\n{rows}\n\n"
            f"<div class=\"caption\">\n\nIn bold on the path: what this chapter changes."
            + (f" The picture: {PICTURES[here]}." if here in PICTURES else "") + "\n\n</div>\n")


def pipeline_table() -> str:
    """The request path as a one-row-per-station table, every chapter on the stations it changes (the wrap-up's
    ``<!-- pipeline -->`` and chapter 00's road map)."""
    rows = []
    for station in PATH:
        chapters = [f"{nn} {title}" for nn, (title, stations) in CHAPTERS.items()
                    if station in stations and stations is not PATH]  # 08 and the wrap-up cover the whole path
        rows.append(f"| {station} | {' · '.join(chapters)} |")
    rows.append(f"| the whole path again, vLLM beside our engine | 08 {CHAPTERS['08'][0]} |")
    return "| station, in the order a request meets it | chapters that change it |\n|---|---|\n" + "\n".join(rows)


PIPELINE = re.compile(r"^<!--\s*pipeline\s*-->[ \t]*$", re.MULTILINE)


def expand(markdown: str, here: str) -> str:
    """Replace each ``<!-- course-map -->`` line of a deck with the map slide's content."""
    markdown = PIPELINE.sub(lambda _: pipeline_table(), markdown)
    return DIRECTIVE.sub(lambda _: course_map(here), markdown)
