"""Widgets render in a real browser from a notebook's saved widget state, and their HTML is right.

The browser tests execute a notebook (nbclient stores the widget state in its metadata), export
it to HTML with local widget JavaScript, and read the DOM headless Chromium builds from it
(see browser_tools.py). They skip, saying what to install, without Chromium or the npm packages
(``apt-get install chromium``; ``npm ci --prefix tests/browser``).
"""
import nbformat
import pytest
from nbclient import NotebookClient

from browser_tools import (ROOT, dump_dom, render_in_browser, require_browser, screenshot,
                           select, visible_text)
from labsupport.viz.block_map import PALETTE, BlockMap, assign_colors, render_html

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# Text the widget renderer shows instead of a widget when something went wrong.
FAILURE_TEXT = ["Loading widget", "Error displaying widget", "Model state has errors",
                "View state has errors", "Could not load"]
# Chapter prefix -> CSS selector that must be in its rendered page once the chapter exists.
CHAPTER_WIDGETS = {"02": ".kv-block-map .kv-block", "03": ".kv-block-map .kv-shared",
                   "04": ".batch-timeline .tl-grid .tl-preempt", "05": ".batch-timeline .tl-grid .tl-prefill",
                   "06": ".server-dashboard svg polyline", "07": ".pd-timeline svg .pd-transfer"}


def fixture_snapshot():
    """40 blocks of 16 slots: 4 requests, block 3 shared by req-0 and req-1, 3 cached blocks."""
    owners = ([["req-0"]] * 3 + [["req-0", "req-1"]] + [["req-1"]] * 2 + [[]] * 4
              + [["req-2"]] * 5 + [[]] * 3 + [["req-3"]] + [[]] * 21)
    tokens = [16 if o else 0 for o in owners]
    tokens[2], tokens[5], tokens[14], tokens[18] = 7, 3, 12, 1
    return {"block_size": 16, "owners": owners, "ref_counts": [len(o) for o in owners],
            "cached": [b in (8, 9, 16) for b in range(len(owners))], "tokens": tokens}


FIXTURE_CELL = f"""\
from labsupport.viz.block_map import BlockMap
block_map = BlockMap(title="fixture pool")
block_map.update({fixture_snapshot()!r})
block_map"""


def execute(nb, cwd, timeout=120):
    """Run a notebook in place, keeping the widget state the kernel produced."""
    NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def assert_widgets_rendered(dom, console):
    """Fail, with the page's console, if the widget manager did not run or reported an error."""
    text = visible_text(dom)
    assert select(dom, ".widget-subarea"), f"no widget was rendered; console: {console}"
    for failure in FAILURE_TEXT:
        assert failure not in text, f"page says {failure!r}; console: {console}"


@pytest.fixture(scope="module")
def fixture_notebook(tmp_path_factory):
    require_browser()
    folder = tmp_path_factory.mktemp("block_map_notebook")
    nb = execute(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(FIXTURE_CELL)]), folder)
    assert WIDGET_STATE in nb.metadata.get("widgets", {}), "nbclient stored no widget state"
    path = folder / "block_map_fixture.ipynb"
    nbformat.write(nb, path)
    return path


def test_block_map_renders_in_browser(fixture_notebook, tmp_path):
    console = []
    dom = render_in_browser(fixture_notebook, tmp_path, console)
    assert_widgets_rendered(dom, console)
    snap = fixture_snapshot()
    # .widget-subarea is created by the widget manager, and script contents (the saved state
    # holds this HTML as a JSON string) are not parsed as elements: these exist only if the
    # widget JavaScript rebuilt the view from the saved state.
    assert len(select(dom, ".widget-subarea .widget-html .kv-block-map")) == 1, console
    blocks = select(dom, ".widget-subarea .kv-block-map .kv-block")
    assert [int(b.attrs["data-block"]) for b in blocks] == list(range(len(snap["owners"])))
    shared = [b for b in blocks if "kv-shared" in b.classes]
    assert [b.attrs["data-block"] for b in shared] == ["3"]
    assert "req-0, req-1" in shared[0].attrs["title"] and "ref count 2" in shared[0].attrs["title"]
    assert sum("kv-used" in b.classes for b in blocks) == 12
    assert sum("kv-cached" in b.classes for b in blocks) == 3
    assert "12/40 blocks used · 4 requests · 1 shared" in visible_text(dom)

    png = screenshot(tmp_path / "block_map_fixture.html", tmp_path / "block_map.png", (900, 500))
    assert png.stat().st_size > 5_000


def test_block_map_needs_the_widget_javascript(fixture_notebook, tmp_path):
    """Control: without the widget renderer the same page has no block squares at all."""
    dom = render_in_browser(fixture_notebook, tmp_path)
    assert select(dom, ".kv-block")
    (tmp_path / "embed-amd.js").unlink()
    dom = dump_dom(tmp_path / "block_map_fixture.html")
    assert not select(dom, ".kv-block") and not select(dom, ".widget-subarea")


@pytest.mark.slow
@pytest.mark.parametrize("prefix", sorted(CHAPTER_WIDGETS))
def test_chapter_widgets_render_in_browser(prefix, tmp_path):
    found = sorted((ROOT / "notebooks").glob(f"{prefix}_*.ipynb"))
    if not found:
        pytest.skip(f"chapter {prefix} not written yet")
    require_browser()
    path = found[0]
    nb = nbformat.read(path, as_version=4)
    if WIDGET_STATE not in nb.metadata.get("widgets", {}):
        # committed without saved widget state: execute a copy (same cell limit as nbval)
        path = tmp_path / found[0].name
        nbformat.write(execute(nb, found[0].parent, timeout=900), path)
    console = []
    dom = render_in_browser(path, tmp_path / "html", console)
    assert_widgets_rendered(dom, console)
    selector = CHAPTER_WIDGETS[prefix]
    assert select(dom, ".widget-subarea " + selector), f"no {selector}; console: {console}"


# ---- render_html and BlockMap, no browser -----------------------------------------------------

def test_render_html_classes_and_counts():
    snap = fixture_snapshot()
    blocks = select(render_html(snap), ".kv-block-map .kv-grid .kv-block")
    assert len(blocks) == 40
    count = {k: sum(k in b.classes for b in blocks)
             for k in ("kv-used", "kv-free", "kv-shared", "kv-cached")}
    assert count == {"kv-used": 12, "kv-free": 28, "kv-shared": 1, "kv-cached": 3}
    assert all(("kv-used" in b.classes) != ("kv-free" in b.classes) for b in blocks)


def test_render_html_styles_and_tooltips():
    snap = fixture_snapshot()
    page = render_html(snap)
    blocks = {int(b.attrs["data-block"]): b for b in select(page, ".kv-block")}
    assert blocks[3].attrs["title"] == ("block 3 · owners: req-0, req-1 · ref count 2 · "
                                        "16/16 tokens filled")
    assert "repeating-linear-gradient" in blocks[3].attrs["style"]  # stripes of both owners
    assert PALETTE[0] in blocks[3].attrs["style"] and PALETTE[1] in blocks[3].attrs["style"]
    assert blocks[0].attrs["style"] == f"background: {PALETTE[0]}"
    assert "cached KV, reusable" in blocks[8].attrs["title"] and "style" not in blocks[8].attrs
    assert blocks[30].attrs["title"].startswith("block 30 · free · ref count 0")
    assert ".kv-block-map .kv-shared {border: 2px solid" in page
    assert ".kv-block-map .kv-cached {border: 1px dashed" in page
    # a partly filled block is veiled over its empty fraction: 3 of 16 filled -> 81% empty
    assert 'class="kv-empty" style="height: 81%"' in page
    assert len(select(page, ".kv-legend i")) == 4 + 3  # 4 requests, free, shared, cached
    assert ("12/40 blocks used · 4 requests · 1 shared · 3 cached · "
            "internal fragmentation 41 slots") in page


def test_render_html_minimal_and_large_snapshots():
    page = render_html({"block_size": 8, "owners": [["a"], []], "ref_counts": [1, 0]})
    assert "1/2 blocks used · 1 request · 0 shared</div>" in page  # no tokens: no fragmentation
    assert "cached" not in visible_text(page)
    big = {"block_size": 16, "owners": [[f"r{b % 7}"] if b % 3 else [] for b in range(600)]}
    page = render_html(big)
    assert len(select(page, ".kv-block")) == 600
    assert len(select(page, ".kv-row-label")) == 19  # ceil(600 / 32) rows, each labelled
    with pytest.raises(ValueError):
        render_html({"block_size": 4, "owners": [[]], "ref_counts": [0, 0]})


def test_colors_are_stable_and_distinct():
    colors = assign_colors([f"r{i}" for i in range(len(PALETTE))], {})
    assert len(set(colors.values())) == len(PALETTE)
    first = dict(colors)
    assign_colors(["r3", "new"], colors)  # only r3 still live: "new" takes the first free colour
    assert colors["r3"] == first["r3"] and colors["new"] == PALETTE[0]


def test_block_map_widget_updates_and_refreshes():
    snaps = iter([{"block_size": 4, "owners": [["x"], []], "ref_counts": [1, 0]},
                  {"block_size": 4, "owners": [["y"], ["x"]], "ref_counts": [1, 1]}])
    block_map = BlockMap(snapshot_fn=lambda: next(snaps), title="pool")
    assert "1/2 blocks used" in block_map.html.value
    x_color = block_map.colors["x"]
    block_map.refresh()
    assert "2/2 blocks used" in block_map.html.value and block_map.colors["x"] == x_color
    assert "application/vnd.jupyter.widget-view+json" in block_map._repr_mimebundle_()
    with pytest.raises(ValueError):
        BlockMap().refresh()
