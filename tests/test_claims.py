"""The claim check: a figure in a chapter's prose must be one of that chapter's outputs."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labsupport import claims

REPO = Path(__file__).resolve().parents[1]
RUN = "prompt 42 tokens, 128 generated\nTTFT 56 ms, TPOT 122 ms\nper-token latency 1.46 s; 8 sequences cost 1.2x\n"


def chapter(tmp_path: Path, markdown: list[str], deck: str | None = None, outputs: str = RUN, nn: str = "07") -> Path:
    """A tree with chapter ``nn``: a notebook of the given markdown cells and one code cell that printed ``outputs``."""
    cells = [nbformat.v4.new_markdown_cell(m) for m in markdown]
    cells.append(nbformat.v4.new_code_cell("run()", outputs=[nbformat.v4.new_output("stream", text=outputs)]))
    (tmp_path / "notebooks").mkdir(exist_ok=True)
    (tmp_path / "slides").mkdir(exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "notebooks" / f"{nn}_x.ipynb")
    if deck is not None:
        (tmp_path / "slides" / f"{nn}_x.md").write_text(deck)
    return tmp_path


def failures(root: Path) -> list[str]:
    return [str(f) for path in claims.default_files(root) for f in claims.check_file(path, root)]


def test_a_true_figure_passes_and_a_planted_one_in_a_markdown_cell_is_named(tmp_path):
    root = chapter(tmp_path, ["# Title", "The first token came after 56 ms; then one every 122 ms."])
    assert failures(root) == []
    root = chapter(tmp_path, ["# Title", "The first token came after 56 ms; then one every 132 ms."])
    [failure] = failures(root)
    assert "07_x.ipynb" in failure and "cell 1" in failure and "132 ms" in failure


def test_a_planted_figure_in_a_deck_is_named_with_its_line(tmp_path):
    deck = "---\nmarp: true\nstyle: |\n  section { font-size: 28px; }\n---\n\n## Latency\n\n- TTFT **56 ms**\n"
    root = chapter(tmp_path, ["# Title"], deck=deck)
    assert failures(root) == []
    root = chapter(tmp_path, ["# Title"], deck=deck + "- TPOT 120 ms\n\n<!-- presenter: about 9x faster -->\n")
    found = failures(root)
    assert len(found) == 2 and "07_x.md: line 10: 120 ms" in found[0] and "line 12: about 9x" in found[1]


@pytest.mark.parametrize("prose, shown", [
    ("1.5 s", True), ("1,460 ms", True), ("1.4 s", False),     # rounding, and s <-> ms
    ("0.12 s", True), ("0.1 s", True), ("0.13 s", False),      # 122 ms
    ("1.2× the time", True), ("1.3x the time", False),
    ("about 130 ms", True), ("about 140 ms", False),           # a hedge allows 10 %
    ("under 60 ms", True), ("under 50 ms", False),             # a bound in the same unit
    ("54 %", True), ("55 %", False),                           # a percentage is shown by a fraction
])
def test_within_its_rounding(tmp_path, prose, shown):
    root = chapter(tmp_path, [f"It measured {prose} here."], outputs=RUN + "hit rate 0.54\n")
    assert (failures(root) == []) is shown


def test_the_cite_marker_covers_its_own_sentence_only(tmp_path):
    cited = "Earlier systems wasted 60–80 % of it. <!-- cite: Kwon et al., SOSP 2023 -->"
    assert failures(chapter(tmp_path, [cited])) == []
    assert len(failures(chapter(tmp_path, [cited.split(" <!--")[0]]))) == 2      # both ends of the range
    [failure] = failures(chapter(tmp_path, [cited + " Ours wasted 12 %."]))
    assert "12 %" in failure


def test_constants_need_their_hardware_named(tmp_path):
    assert failures(chapter(tmp_path, ["An H200 reads 4.8 TB/s."])) == []
    assert len(failures(chapter(tmp_path, ["Our copy reads 4.8 TB/s."]))) == 1


def test_code_words_and_plain_counts_are_not_figures(tmp_path):
    prose = ("SmolLM2-135M on a 2-core CPU: P99 of 48 tokens, `sleep(30 s)`, Llama-3-8B, chapters 00-05.\n\n"
             "```text\nstep 4   4 decodes   999 ms\n```\n\n![bg right:45%](figures/x.png)")
    assert failures(chapter(tmp_path, [prose])) == []


def test_a_table_column_gives_its_unit_in_prose_and_in_outputs(tmp_path):
    table = "| chunk | ITL P99 (ms) |\n|---|---:|\n| 64 | 175 |\n"
    printed = "| chunk | ITL P99 ms |\n| --- | --- |\n| 64 | 175.2 |\n"
    assert failures(chapter(tmp_path, [table], outputs=printed)) == []
    [failure] = failures(chapter(tmp_path, [table.replace("175", "176")], outputs=printed))
    assert "176 ms" in failure
    assert failures(chapter(tmp_path, ["The P99 was 175 ms."], outputs="duration (ms)   175.2\n")) == []


def test_saved_data_counts_only_where_the_chapter_declares_it(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "run.json").write_text(json.dumps({"rows": [{"ttft_p50_ms": 907.2, "seconds": 325.3, "usd_per_mtok": 0.324}]}))
    prose = "TTFT P50 was 907 ms at $0.32 per million tokens, and the run took about 5.4 minutes."
    assert len(failures(chapter(tmp_path, [prose]))) == 3
    assert failures(chapter(tmp_path, [prose + "\n<!-- data: data/run.json -->"])) == []


def make_claims(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "claims", f"BIN={Path(sys.executable).parent}"], cwd=root,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_claims_passes_on_chapter_00_and_fails_on_one_planted_number(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path)
    shutil.copytree(REPO / "labsupport", tmp_path / "labsupport", ignore=shutil.ignore_patterns("__pycache__"))
    for folder, pattern in (("notebooks", "00_*.ipynb"), ("slides", "00_*.md")):
        (tmp_path / folder).mkdir()
        for path in (REPO / folder).glob(pattern):
            shutil.copy(path, tmp_path / folder)
    result = make_claims(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

    deck = next((tmp_path / "slides").glob("00_*.md"))
    text = deck.read_text()
    deck.write_text(text.replace("\n## Summary", "\nIt answered in 12.3 ms.\n\n## Summary", 1))
    result = make_claims(tmp_path)
    assert result.returncode != 0 and "00_from_model_to_api.md: line" in result.stdout and "12.3 ms" in result.stdout
    deck.write_text(text)

    path = next((tmp_path / "notebooks").glob("00_*.ipynb"))
    nb = nbformat.read(path, as_version=4)
    cell = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "Summary" in c.source)
    nb.cells[cell].source += "\n\nThe loop ran 17.5x slower than the engine."
    nbformat.write(nb, path)
    result = make_claims(tmp_path)
    assert result.returncode != 0 and f"cell {cell}" in result.stdout and "17.5x" in result.stdout
