"""The slides toolchain: figures come from tagged notebook cells, decks build offline.

The builds run on a tiny fixture notebook and deck in a temporary folder, so these tests need
neither the course model nor executed course notebooks. Building needs Marp
(`npm ci --prefix slides`); the PDF test also needs Chromium. Without them those tests skip
and say why.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "slides" / "build.py"
MARP = REPO / "slides" / "node_modules" / ".bin" / "marp"


def load_build_module():
    spec = importlib.util.spec_from_file_location("slides_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_png(width: int = 24, height: int = 16) -> bytes:
    """A real PNG (a colour gradient) written with zlib, so no imaging library is needed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + bytes(c for x in range(width) for c in (10 * x % 256, 15 * y % 256, 200))
                    for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def write_notebook(path: Path, tag: str, png: bytes | None) -> None:
    cell = nbformat.v4.new_code_cell("plot()", metadata={"tags": ["hide-input", tag]})
    data = {"text/plain": "<Figure size 640x480>"}
    if png is not None:
        data["image/png"] = base64.b64encode(png).decode()
    cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell("# Fixture"), cell]
    nbformat.write(notebook, path)


DECK = """---
marp: true
paginate: true
---

# Fixture deck title

The first slide's text

---

## A figure from the notebook

![w:300](figures/07_demo.png)
"""


@pytest.fixture
def project(tmp_path):
    """notebooks/07_fixture.ipynb with a `slide:demo` PNG cell, and slides/07_fixture.md."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "slides").mkdir()
    png = tiny_png()
    write_notebook(tmp_path / "notebooks" / "07_fixture.ipynb", "slide:demo", png)
    (tmp_path / "slides" / "07_fixture.md").write_text(DECK)
    return tmp_path, png


def build(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILD), "--notebooks", str(root / "notebooks"),
                           "--slides", str(root / "slides"), "--out", str(root / "out"), *extra],
                          capture_output=True, text=True, timeout=300)


def need_marp():
    if not MARP.exists():
        pytest.skip("Marp is not installed: run `npm ci --prefix slides` to build decks")
    if shutil.which("node") is None:
        pytest.skip("node is not on PATH: Marp cannot run")


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROME_PATH"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def test_html_deck_is_self_contained(project):
    need_marp()
    root, png = project
    result = build(root)
    assert result.returncode == 0, result.stderr
    assert (root / "slides" / "figures" / "07_demo.png").read_bytes() == png
    html_path = root / "out" / "07_fixture.html"
    assert str(html_path) in result.stdout
    html = html_path.read_text()
    assert "Fixture deck title" in html and "first slide" in html
    assert "data:image/png;base64," + base64.b64encode(png).decode()[:60] in html
    assert "figures/07_demo.png" not in html, "the figure should be inlined, not referenced"
    assert load_build_module().external_loads(html) == []
    for tag in re.findall(r"<(?:script|link|img|iframe)\b[^>]*>", html):
        assert "http" not in tag, tag


def test_external_load_check_catches_cdn():
    check = load_build_module().external_loads
    assert check('<script src="https://cdn.example.com/x.js"></script>')
    assert check('<link rel="stylesheet" href="//fonts.example.com/a.css">')
    assert check("<style>@import url('https://fonts.googleapis.com/css?family=Lato');</style>")
    assert check("<style>h1{background:url(http://example.com/a.png)}</style>")
    assert not check('<a href="https://example.com">a link is not a load</a><img src="data:image/png;base64,AA">')


def test_pdf_deck(project):
    need_marp()
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium (apt-get install chromium, or set CHROME_PATH): PDF not tested")
    root, _ = project
    result = build(root, "--pdf")
    assert result.returncode == 0, result.stderr
    pdf = root / "out" / "07_fixture.pdf"
    assert pdf.read_bytes().startswith(b"%PDF")
    assert pdf.stat().st_size > 1000


def test_missing_figure_is_an_error(project):
    root, _ = project
    deck = root / "slides" / "07_fixture.md"
    deck.write_text(DECK + "\n---\n\n![](figures/07_never_made.png)\n")
    result = build(root)
    assert result.returncode != 0
    assert "07_never_made.png" in result.stderr and "07_fixture.md" in result.stderr
    assert not (root / "out" / "07_fixture.html").exists()


def test_tagged_cell_without_png_is_an_error(project):
    root, _ = project
    write_notebook(root / "notebooks" / "07_fixture.ipynb", "slide:demo", png=None)
    result = build(root)
    assert result.returncode != 0
    assert "07_fixture.ipynb" in result.stderr and "slide:demo" in result.stderr
    assert "image/png" in result.stderr


def test_exercises_and_only_are_respected(project):
    root, _ = project
    (root / "notebooks" / "exercises").mkdir()
    write_notebook(root / "notebooks" / "exercises" / "07_ex.ipynb", "slide:broken", png=None)
    write_notebook(root / "notebooks" / "08_other.ipynb", "slide:broken", png=None)
    module = load_build_module()
    written = module.extract_figures(root / "notebooks", root / "slides" / "figures", {"07"})
    assert [p.name for p in written] == ["07_demo.png"]


def load_notebook_text():
    spec = importlib.util.spec_from_file_location("notebook_text", REPO / "slides" / "notebook_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_text_notebook(path: Path, tag: str, markdown: str | None) -> None:
    cell = nbformat.v4.new_code_cell("display(Markdown(reading))", metadata={"tags": [tag]})
    data = {"text/plain": "<IPython.core.display.Markdown object>"}
    if markdown is not None:
        data["text/markdown"] = markdown
    cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [cell]
    nbformat.write(notebook, path)


def test_notebook_text_puts_the_cells_printed_sentence_on_the_slide(tmp_path):
    text = load_notebook_text()
    write_text_notebook(tmp_path / "09_x.ipynb", "slide-text:speed", "* **k = 4**: 1.51x plain decoding")
    deck = "## Speed\n\n<!-- output: speed -->\n\n---\n\n<!-- output: 09 speed -->\n"
    out = text.expand(deck, "09", tmp_path)
    assert out.count("* **k = 4**: 1.51x plain decoding") == 2 and "output" not in out
    with pytest.raises(ValueError, match="no notebooks/10_"):
        text.expand("<!-- output: speed -->", "10", tmp_path)


def test_notebook_text_keeps_the_blank_line_before_the_next_slide(tmp_path):
    """Without it, the printed sentence followed by ``---`` would render as a heading and swallow the next slide."""
    text = load_notebook_text()
    write_text_notebook(tmp_path / "05_x.ipynb", "slide-text:stall", "The worst gap is 43x a typical step.")
    out = text.expand("## Stall\n\n<!-- output: stall -->\n\n---\n\n## Next\n", "05", tmp_path)
    assert "43x a typical step.\n\n---\n" in out


def test_notebook_text_without_its_cell_or_output_is_an_error(project):
    root, _ = project
    need_marp()
    deck = root / "slides" / "07_fixture.md"
    deck.write_text(DECK + "\n---\n\n<!-- output: never_printed -->\n")
    result = build(root)
    assert result.returncode != 0 and "slide-text:never_printed" in result.stderr and "07_fixture.md" in result.stderr
    text = load_notebook_text()
    write_text_notebook(root / "notebooks" / "08_y.ipynb", "slide-text:empty", None)
    with pytest.raises(ValueError, match="no text/markdown output"):
        text.expand("<!-- output: empty -->", "08", root / "notebooks")


def test_deck_outputs_match_notebook_tags():
    """Every ``<!-- output: name -->`` of a deck has a ``slide-text:name`` cell with markdown in its notebook."""
    text = load_notebook_text()
    for deck in sorted((REPO / "slides").glob("[0-9][0-9]_*.md")):
        try:
            text.expand(deck.read_text(), deck.name[:2], REPO / "notebooks")
        except ValueError as error:
            raise AssertionError(f"{deck}: {error}") from error


def course_notebooks() -> list[Path]:
    return sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_notebook_has_a_deck():
    notebooks = course_notebooks()
    if not notebooks:
        pytest.skip("no notebooks/NN_*.ipynb yet")
    decks = {p.name[:2] for p in (REPO / "slides").glob("[0-9][0-9]_*.md")}
    missing = [nb.name for nb in notebooks if nb.name[:2] not in decks]
    assert not missing, f"notebooks without a slides/NN_*.md deck: {missing}"


def test_deck_figures_match_notebook_tags():
    """Every figures/NN_<name>.png a deck shows has a `slide:<name>` cell in notebook NN.

    Reads tags only, so it catches a renamed tag without executing anything."""
    notebooks = {nb.name[:2]: nb for nb in course_notebooks()}
    if not notebooks:
        pytest.skip("no notebooks/NN_*.ipynb yet")
    problems = []
    for deck in sorted((REPO / "slides").glob("[0-9][0-9]_*.md")):
        for chapter, name in re.findall(r"figures/(\d\d)_([A-Za-z0-9_-]+)\.png", deck.read_text()):
            if chapter not in notebooks:
                continue
            tags = {t for cell in nbformat.read(notebooks[chapter], as_version=4).cells
                    for t in cell.get("metadata", {}).get("tags", [])}
            if f"slide:{name}" not in tags:
                problems.append(f"{deck.name} shows figures/{chapter}_{name}.png but "
                                f"{notebooks[chapter].name} has no cell tagged slide:{name}")
    assert not problems, "\n".join(problems)


def test_deck_texts_match_notebook_tags():
    """Every ``output`` line of a deck has its ``slide-text:`` cell, with Markdown output, in the notebook."""
    notebooks = {nb.name[:2]: nb for nb in course_notebooks()}
    if not notebooks:
        pytest.skip("no notebooks/NN_*.ipynb yet")
    text, problems = load_notebook_text(), []
    for deck in sorted((REPO / "slides").glob("[0-9][0-9]_*.md")):
        for chapter, name in text.DIRECTIVE.findall(deck.read_text()):
            chapter = chapter or deck.name[:2]
            try:
                text.cell_markdown(notebooks[chapter], name)
            except (KeyError, ValueError) as error:
                problems.append(f"{deck.name}: {error!r}")
    assert not problems, "\n".join(problems)


def test_course_decks_build_from_the_committed_notebooks(tmp_path):
    """The real decks, with the figures the executed chapters really produced, and no page overflowing."""
    need_marp()
    chromium = find_chromium()
    done = subprocess.run([sys.executable, str(BUILD), "--out", str(tmp_path), *(["--pdf"] if chromium else [])],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    decks = sorted(p.stem for p in (BUILD.parent).glob("[0-9][0-9]_*.md"))
    assert decks and all((tmp_path / f"{d}.html").exists() for d in decks)
    if chromium is None:
        pytest.skip("no Chromium (apt-get install chromium, or set CHROME_PATH): HTML built, "
                    "but no PDF and no overflow check")
    assert all((tmp_path / f"{d}.pdf").stat().st_size > 10_000 for d in decks)
    assert done.stdout.count("none beyond the slide or over the footer") == len(decks)


def need_chromium():
    need_marp()
    if find_chromium() is None:
        pytest.skip("no Chromium (apt-get install chromium, or set CHROME_PATH): overflow check not tested")


def test_overflow_check_passes_a_deck_that_fits(project):
    need_chromium()
    root, _ = project
    result = build(root)
    assert result.returncode == 0, result.stderr
    assert "07_fixture.md: 2 pages, none beyond the slide or over the footer" in result.stdout


def test_overflow_check_names_deck_and_page_of_an_overflowing_slide(project):
    """Too many lines on page 3, a figure too tall for page 4: both named, the build fails."""
    need_chromium()
    root, _ = project
    lines = "\n".join(f"- line {i} of a slide that says too much" for i in range(1, 31))
    deck = root / "slides" / "07_fixture.md"
    deck.write_text(DECK + f"\n---\n\n## Too long\n\n{lines}\n\n---\n\n![h:900](figures/07_demo.png)\n")
    result = build(root)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, result.stderr
    assert "07_fixture.md: page 3: <li> \"line 30 of a slide" in errors[0] and "below the footer line" in errors[0]
    assert "07_fixture.md: page 4: <img>" in errors[1] and "below the footer line" in errors[1]


def test_missing_marp_is_reported_once(project, monkeypatch, capsys):
    """Without Marp no deck can be built: one error says so, not one per deck."""
    root, _ = project
    (root / "slides" / "08_second.md").write_text(DECK)
    module = load_build_module()
    monkeypatch.setattr(module, "find_marp", lambda: None)
    status = module.main(["--notebooks", str(root / "notebooks"), "--slides", str(root / "slides"),
                          "--out", str(root / "out")])
    assert status == 1
    assert capsys.readouterr().err.count("marp not found") == 1


def load_course_map():
    spec = importlib.util.spec_from_file_location("course_map", REPO / "slides" / "course_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_deck_opens_with_the_course_map():
    decks = sorted((REPO / "slides").glob("[0-9][0-9]_*.md"))
    cmap = load_course_map()
    for deck in decks:
        text = deck.read_text()
        slides = text.split("\n---\n")
        assert cmap.DIRECTIVE.search(slides[2]), f"{deck.name}: the course map should be the second slide"
        assert deck.name[:2] in cmap.CHAPTERS


def test_course_map_highlights_its_chapter_and_what_it_changes():
    cmap = load_course_map()
    slide = cmap.course_map("05")
    assert slide.count("<mark>") == 1 and "<mark>**05 chunked prefill**</mark>" in slide
    assert "**scheduler** → **prefill**" in slide and "**decode**" not in slide
    expanded = cmap.expand("# deck\n\n<!-- course-map -->\n\n---\nmore", "02")
    assert "<!-- course-map -->" not in expanded and "<mark>**02 PagedAttention**</mark>" in expanded
    with pytest.raises(ValueError):
        cmap.course_map("42")
    for nn, (_, stations) in cmap.CHAPTERS.items():
        assert set(stations) <= set(cmap.PATH), nn


def test_the_pipeline_places_every_chapter_and_chapter_00_shows_the_maps_own_table():
    cmap = load_course_map()
    table = cmap.pipeline_table()
    stations = [row.split("|")[1].strip() for row in table.splitlines()[2:]]
    assert stations[:len(cmap.PATH)] == cmap.PATH and "KV transfer" in stations and "router" in stations
    for nn in [nn for nn in cmap.CHAPTERS if nn != "10"]:
        assert f"{nn} {cmap.CHAPTERS[nn][0]}" in table, f"chapter {nn} is not on the pipeline"
    assert "<!-- pipeline -->" not in cmap.expand("# deck\n\n<!-- pipeline -->\n", "10")
    chapter00 = json.loads((REPO / "notebooks" / "00_from_model_to_api.ipynb").read_text())
    prose = "\n".join("".join(c["source"]) for c in chapter00["cells"] if c["cell_type"] == "markdown")
    assert table in prose, "chapter 00's road map differs from slides/course_map.py's pipeline_table()"
    wastes = [waste for waste, _, _ in cmap.WASTES]
    assert "prefill/decode interference" in wastes, "interference is its own waste, not folded into 'idle'"


# ------------------------------------------------------------ presenting and instructor decks (slides/debrief.py)

def load_debrief():
    spec = importlib.util.spec_from_file_location("debrief", REPO / "slides" / "debrief.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOLUTION = re.compile(r"# BEGIN SOLUTION\n(.*?)# END SOLUTION", re.DOTALL)
# Shorter lines (`break`, `return n`, `else:`) occur in any code: only a line this long, without spaces, is a
# solution's own; every line of every solution block above it counts.
MIN_SOLUTION_CHARS = 16


def squeeze(line: str) -> str:
    """A code line without its comment and whitespace, so re-indented or re-spaced copies still compare equal."""
    return re.sub(r"\s+", "", re.sub(r"\s+#.*$", "", line))


def solution_lines(notebook: Path) -> list[str]:
    """Every squeezed line of the notebook's solution blocks (``# BEGIN SOLUTION ... # END SOLUTION``) long enough
    to be telling."""
    cells = json.loads(notebook.read_text())["cells"]
    blocks = [block for cell in cells if cell["cell_type"] == "code"
              for block in SOLUTION.findall("".join(cell["source"]))]
    return list(dict.fromkeys(s for block in blocks for line in block.splitlines()
                              if len(s := squeeze(line)) >= MIN_SOLUTION_CHARS))


def leaked_lines(markdown: str, lines: list[str]) -> list[str]:
    """The solution lines that a deck's Markdown shows, in code or in prose."""
    deck = re.sub(r"\s+", "", markdown)
    return [line for line in lines if line in deck]


# Answers the decks once gave in prose or in other names than the solution's: each must stay in the debrief.
PARAPHRASED_ANSWERS = {
    "00": ["next_id = int(logits[-1].argmax())"],
    "01": ["cache_k[start:start + n] = k"],
    "02": ["table[p // B] × B + p % B", "block_tables.repeat_interleave(block_size, 1) * block_size",
           "a decode row whose context ends at its **own position**"],
    "03": ["parent = hash_block(parent,", "ref_counts[b] > len(owners[b])", "Free **tail first**",
           "A **cached free** one costs one", "copy it (`new_block`, `copy_block(src, dst)`)"],
    "04": ["**Preempt the newest**"],
    "05": ["a prompt **alone** in its step starts whatever its size", "the pool must hold the hit and **this chunk**"],
    "08": ["(queued tokens + this prompt's tokens) × its seconds per token"],
    "09": ["min(1, p(d) / q(d))", "max(p − q, 0)"],
}


def course_decks() -> dict[str, Path]:
    return {deck.name[:2]: deck for deck in sorted((REPO / "slides").glob("[0-9][0-9]_*.md"))}


def test_no_presenting_deck_shows_an_exercise_solution():
    """The presenting build holds no line of any chapter's solution blocks, nor the answers once paraphrased."""
    debrief, decks, problems = load_debrief(), course_decks(), []
    for notebook in course_notebooks():
        chapter = notebook.name[:2]
        if chapter not in decks:
            continue
        presenting = debrief.select(decks[chapter].read_text(), instructor=False)
        problems += [f"{decks[chapter].name}: solution line {line!r}"
                     for line in leaked_lines(presenting, solution_lines(notebook))]
        problems += [f"{decks[chapter].name}: answer {answer!r}" for answer in PARAPHRASED_ANSWERS.get(chapter, [])
                     if answer in presenting]
    assert not problems, "move these to the deck's debrief section (<!-- debrief --> slides):\n" + "\n".join(problems)


def test_the_leak_check_catches_a_solution_line_planted_in_a_presenting_slide(tmp_path):
    """Proof that the test above can fail: one line of chapter 02's paged read, planted mid-deck, is found;
    the same line on a debrief slide is not, since the presenting build drops it."""
    notebook = REPO / "notebooks" / "02_paged_attention.ipynb"
    lines = solution_lines(notebook)
    planted = "    group = heads // num_kv_heads           # re-spaced and re-commented: still the solution's"
    assert squeeze(planted) in lines
    debrief = load_debrief()
    deck = course_decks()["02"].read_text()
    head, slides = debrief.split_slides(deck)
    slides[3] += f"\n```python\n{planted}\n```\n"
    mid_deck = head + "---\n".join(slides)
    assert leaked_lines(debrief.select(mid_deck, instructor=False), lines) == [squeeze(planted)]
    in_debrief = deck.rstrip("\n") + f"\n\n---\n\n<!-- debrief -->\n\n```python\n{planted}\n```\n"
    assert leaked_lines(debrief.select(in_debrief, instructor=False), lines) == []


def test_the_instructor_deck_keeps_the_debrief_and_the_presenting_deck_drops_it():
    debrief, decks = load_debrief(), course_decks()
    for chapter, answers in PARAPHRASED_ANSWERS.items():
        text = decks[chapter].read_text()
        instructor, presenting = debrief.select(text, instructor=True), debrief.select(text, instructor=False)
        assert all(answer in instructor for answer in answers), f"{decks[chapter].name}: the debrief lost an answer"
        assert "<!-- debrief -->" not in instructor, "the marker would show as a presenter note"
        head, slides = debrief.split_slides(text)
        kept = [s for s in slides if not debrief.is_debrief(s)]
        assert len(kept) < len(slides) and presenting == head + "---\n".join(kept)
        assert debrief.split_slides(instructor)[1] == [s.replace("<!-- debrief -->", "") for s in slides]


def test_a_debrief_slide_before_the_exercise_time_is_an_error():
    deck = "---\nmarp: true\n---\n\n# Title\n\n---\n\n<!-- debrief -->\n\n## Answer\n\n---\n\n## Exercise\n"
    with pytest.raises(ValueError, match="slide 2 is marked <!-- debrief --> but slide 3"):
        load_debrief().select(deck, instructor=False)


def test_slide_breaks_inside_code_fences_do_not_split_a_slide():
    deck = "---\nmarp: true\n---\n\n# A\n\n```text\n---\n```\n\n---\n\n<!-- debrief -->\n## B\n"
    head, slides = load_debrief().split_slides(deck)
    assert head == "---\nmarp: true\n---\n" and len(slides) == 2 and "```text\n---\n```" in slides[0]


def test_instructor_build_writes_the_debrief_beside_the_presenting_deck(project):
    """`--instructor` builds into <out>/instructor/ with the debrief slide; the plain build leaves it out."""
    need_marp()
    root, _ = project
    (root / "slides" / "07_fixture.md").write_text(DECK + "\n---\n\n<!-- debrief -->\n\n## The answer slide\n")
    assert build(root).returncode == 0
    assert build(root, "--instructor").returncode == 0
    assert "The answer slide" not in (root / "out" / "07_fixture.html").read_text()
    assert "The answer slide" in (root / "out" / "instructor" / "07_fixture.html").read_text()
