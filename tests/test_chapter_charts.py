"""The chapters' result plots draw what they are given: one series per level or policy, labels that say
what a bar is (P99 or max)."""
import matplotlib

matplotlib.use("Agg")

from labsupport.viz import chapter_charts  # noqa: E402


def test_block_size_tradeoff_marks_the_chosen_size():
    sweep = [{"block_size": b, "fragmentation": f, "step_ms": 10 + b / 8, "step_quartiles_ms": (9 + b / 8, 11 + b / 8),
              "table_entries": 256 // b} for b, f in [(1, 0.0), (16, 1.5), (128, 12.0)]]
    fig = chapter_charts.plot_block_size_tradeoff(sweep, 16, "footnote")
    left = fig.axes[0]
    assert [t.get_text() for t in left.texts] == ["0.0%", "1.5%", "12.0%"]
    assert any(list(line.get_xdata()) == [16, 16] for line in left.get_lines())


def test_cache_levels_draw_every_level_in_both_panels():
    rows = lambda ttft, computed: [{"ttft": ttft, "prompt_tokens_computed": c} for c in computed]   # noqa: E731
    runs = {"a": rows(1.0, [900, 900, 900]), "b": rows(0.5, [900, 40, 41]), "c": rows(0.5, [900, 40, 41]),
            "c'": rows(0.9, [900, 900, 900]), "d": rows(0.01, [0, 0, 0])}
    names = {k: f"({k})" for k in runs}
    fig = chapter_charts.plot_cache_levels(runs, names, "title", "footnote")
    left, right = fig.axes[:2]
    assert len(left.get_lines()) == 5 and len(right.get_lines()) == 6     # and the 10 % line
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["(a)", "(b)", "(c)", "(c')", "(d) (whole answer)"]


def test_policy_comparison_labels_a_small_sample_tail_as_max():
    from types import SimpleNamespace

    from labsupport.bench.summary import summarize

    def out(t):
        return SimpleNamespace(metrics=SimpleNamespace(ttft=t, tpot=0.01, itl=[0.01], latency=t + 0.01,
                                                       queueing_time=0.0), token_ids=[1, 2])
    summaries = {"static": summarize([out(0.1 * i) for i in range(1, 9)], 2.0),
                 "continuous": summarize([out(0.05 * i) for i in range(1, 9)], 1.0)}
    fig = chapter_charts.plot_policy_comparison(summaries, "title", "footnote")
    assert len(fig.axes) == 4 and "max" in [t.get_text() for t in fig.axes[1].texts]


def test_rate_sweep_draws_served_against_offered_and_labels_each_tail():
    from types import SimpleNamespace

    from labsupport.bench.summary import summarize

    def run(n, ttft, seconds):
        outs = [SimpleNamespace(metrics=SimpleNamespace(ttft=ttft * (1 + i / n), tpot=0.01, itl=[0.01],
                                                        latency=ttft + 0.1, queueing_time=0.0), token_ids=[1, 2])
                for i in range(n)]
        return summarize(outs, seconds)
    summaries = [run(24, 0.05, 12.0), run(50, 0.08, 12.5), run(100, 2.0, 25.0)]   # the last one saturated
    fig = chapter_charts.plot_rate_sweep([2.0, 4.0, 8.0], summaries, 4.0, "title", "footnote")
    left, right = fig.axes
    served = next(line for line in left.get_lines() if line.get_label() == "served")
    assert list(served.get_ydata()) == [2.0, 4.0, 4.0]
    assert [t.get_text() for t in right.texts] == ["max, n=24", "max, n=50", "P99, n=100"]
    assert "TTFT max/P99" in [t.get_text() for t in right.get_legend().get_texts()]
    assert right.get_yscale() == "log" and "ms" in right.get_ylabel()
