"""Static checks on the committed chapters: what nbval alone would not catch."""
import json
import re

import pytest

from notebook_tools import CHAPTERS, ROOT, read


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_was_executed_top_to_bottom(path):
    counts = [c.execution_count for c in read(path).cells if c.cell_type == "code" and c.source.strip()]
    assert counts == list(range(1, len(counts) + 1)), "run `make execute` (Restart & Run All) before committing"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_outputs_carry_no_machine_paths(path):
    outputs = json.dumps([c.get("outputs", []) for c in read(path).cells])
    assert not re.search(r"(/tmp/|/root/|/work/|/home/[a-z]|site-packages)", outputs)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_states_goals_time_and_has_parameters(path):
    nb = read(path)
    intro = nb.cells[0].source.lower()
    assert "learning goals" in intro and "time:" in intro
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and 'DEVICE = "auto"' in params[0].source


def test_readme_lists_every_chapter():
    readme = (ROOT / "README.md").read_text()
    for path in CHAPTERS:
        assert path.name in readme, f"README.md does not list {path.name}"
