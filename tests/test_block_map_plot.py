"""The static block map (decks, saved notebooks) draws the same state as the live widget."""
import matplotlib

matplotlib.use("Agg")

from labsupport.viz.block_map import plot_block_map, summarize  # noqa: E402


def snapshot():
    return {"block_size": 4,
            "owners": [["a"], ["a", "b"], ["b"], [], [], ["c"]],
            "ref_counts": [1, 2, 1, 0, 0, 1],
            "cached": [False, False, False, True, False, False],
            "tokens": [4, 4, 1, 0, 0, 3]}


def test_plot_block_map_draws_every_block_and_the_summary():
    fig = plot_block_map(snapshot(), title="pool", columns=4)
    ax = fig.axes[0]
    squares = [p for p in ax.patches if p.get_width() == 0.9 and p.get_height() == 0.9]
    assert len(squares) == 6                                     # one square per block
    shared = [p for p in squares if p.get_linewidth() == 2]
    assert len(shared) == 1 and [t.get_text() for t in ax.texts] == ["2"]   # block 1, ref count 2
    veils = [p for p in ax.patches if p.get_height() < 0.9]
    assert len(veils) == 2                                       # blocks 2 and 5 are partly filled
    s = summarize(snapshot())
    assert f"{s['used']}/{s['blocks']} blocks used" in ax.get_title(loc="left") and "1 cached" in ax.get_title(loc="left")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:3] == ["a", "b", "c"] and "cached, reusable" in labels


def test_plot_block_map_keeps_the_widget_colours():
    colors = {}
    plot_block_map(snapshot(), colors=colors)
    first = dict(colors)
    plot_block_map(snapshot(), colors=colors)
    assert colors == first and len(set(first.values())) == 3


def test_plot_block_map_marks_a_leaked_block():
    from matplotlib.colors import to_hex

    from labsupport.viz.block_map import ORPHAN

    leak = {"block_size": 4, "owners": [[], ["a"], [], []], "ref_counts": [1, 1, 0, 0], "tokens": [0, 3, 0, 0],
            "cached": [False] * 4}
    ax = plot_block_map(leak, columns=4).axes[0]
    squares = [p for p in ax.patches if p.get_width() == 0.9 and p.get_height() == 0.9]
    assert to_hex(squares[0].get_facecolor()) == ORPHAN and to_hex(squares[2].get_facecolor()) != ORPHAN
    assert "held, no request owns it" in [t.get_text() for t in ax.get_legend().get_texts()]
    s = summarize(leak)  # the held block's 4 empty slots are not fragmentation: only a's last block's 1
    assert s["unowned"] == 1 and s["fragmentation"] == 1 and "1 held by no request" in ax.get_title(loc="left")
    healthy = plot_block_map(snapshot(), columns=4).axes[0]
    assert "held, no request owns it" not in [t.get_text() for t in healthy.get_legend().get_texts()]
