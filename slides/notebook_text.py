"""Numbers on a slide come from the executed notebook, as its figures do.

A deck line ``<!-- output: NAME -->`` (or ``<!-- output: NN NAME -->`` for another chapter's
notebook) is replaced, before Marp runs, by the Markdown output of the code cell tagged ``slide-text:NAME``
in ``notebooks/NN_*.ipynb``: a sentence the cell printed from the values it measured
(``display(Markdown(...))``). Re-execute the notebook and the deck says what the new run measured.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

DIRECTIVE = re.compile(r"^<!--\s*output:\s*(?:(\d\d)\s+)?([A-Za-z0-9_-]+)\s*-->[ \t]*$", re.MULTILINE)
TAG_PREFIX = "slide-text:"


def cell_markdown(notebook: Path, name: str) -> str:
    """The ``text/markdown`` outputs of the cell tagged ``slide-text:<name>``; ValueError naming what is wrong."""
    cells = [c for c in nbformat.read(notebook, as_version=4).cells
             if f"{TAG_PREFIX}{name}" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"{notebook}: {len(cells)} cells tagged '{TAG_PREFIX}{name}' (one is needed)")
    texts = []
    for output in cells[0].get("outputs", []):
        markdown = output.get("data", {}).get("text/markdown")
        if markdown is not None:
            texts.append("".join(markdown) if isinstance(markdown, list) else markdown)
    if not texts:
        raise ValueError(f"{notebook}: the cell tagged '{TAG_PREFIX}{name}' has no text/markdown output "
                         "(execute the notebook and save it with its outputs)")
    return "\n\n".join(t.strip() for t in texts)


def expand(markdown: str, here: str, notebooks_dir: Path) -> str:
    """Replace each ``output`` line of deck ``here`` (its chapter number) with the cell's Markdown."""
    def replace(match: re.Match) -> str:
        chapter, name = match.group(1) or here, match.group(2)
        found = sorted(notebooks_dir.glob(f"{chapter}_*.ipynb"))
        if not found:
            raise ValueError(f"output '{name}': no notebooks/{chapter}_*.ipynb in {notebooks_dir}")
        return cell_markdown(found[0], name)
    return DIRECTIVE.sub(replace, markdown)
