"""The measurement discipline (``labsupport/measure.py``) on planted data: samples whose true ratio is known."""
import numpy as np
import pytest

from labsupport.measure import (AGAIN, Band, Interval, Verdict, interleaved, median_and_tail, noise_band, one_run_each,
                                ratio_interval, tail_with_n, trend, verdict, with_n)
from labsupport.measure import MIN_RUNS

FAST = {"n_resamples": 500}  # the tests' intervals: enough resamples to place their ends, quick on one core


def three_draws(seed: int, n: int, sigma: float, shift: float):
    """A, A again, and B = shift x A's distribution: lognormal noise of ``sigma`` around 1 (about sigma x 100 %)."""
    rng = np.random.default_rng(seed)
    return rng.lognormal(0, sigma, n), rng.lognormal(0, sigma, n), shift * rng.lognormal(0, sigma, n)


def word(a, a_again, b, seed, **kw):
    return verdict(a, b, noise_band(a, a_again, seed=seed, **FAST), seed=seed, **FAST, **kw).word


def test_samples_from_one_distribution_read_level_in_nine_seeds_of_ten():
    words = [word(*three_draws(seed, 30, 0.2, 1.0), seed) for seed in range(40)]
    assert words.count("level") >= 36, words


def test_a_planted_1_3x_shift_reads_higher_and_the_reverse_lower():
    for seed in range(10):
        a, a_again, b = three_draws(seed, 30, 0.1, 1.3)
        assert word(a, a_again, b, seed) == "higher"
        assert word(*three_draws(seed, 30, 0.1, 1 / 1.3), seed) == "lower"


def test_a_3_percent_shift_in_noisy_data_reads_level():
    assert {word(*three_draws(seed, 30, 0.2, 1.03), seed) for seed in range(10)} == {"level"}


def test_the_band_always_contains_one():
    a = np.linspace(1.0, 2.0, 20)
    for factor in (0.5, 0.9, 1.0, 1.1, 2.0):  # a run again that drifted far either way still yields a band holding 1
        band = noise_band(a, factor * a, **FAST)
        assert band.low <= 1.0 <= band.high and 1.0 in band and band.n == 20
    assert noise_band(a, 2 * a, paired=True, **FAST) == Band(1.0, 2.0, 20)  # every resample 2x: widened to 1


def test_the_same_seed_gives_the_same_interval():
    a, _, b = three_draws(0, 25, 0.2, 1.1)
    assert ratio_interval(a, b, seed=7, **FAST) == ratio_interval(a, b, seed=7, **FAST)
    assert ratio_interval(a, b, seed=7, **FAST) != ratio_interval(a, b, seed=8, **FAST)


def test_the_interval_holds_the_ratio_of_the_statistic_and_the_counts():
    iv = ratio_interval([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0], stat="mean", **FAST)
    assert iv.ratio == pytest.approx(5.0 / 2.0) and (iv.n_a, iv.n_b) == (3, 4) and iv.low <= iv.ratio <= iv.high
    tenth = ratio_interval([1.0] * 9 + [5.0], [2.0] * 9 + [7.0], stat=lambda x: np.percentile(x, 90), **FAST)
    assert tenth.ratio == pytest.approx(np.percentile([2.0] * 9 + [7.0], 90) / np.percentile([1.0] * 9 + [5.0], 90))


@pytest.mark.parametrize("stat", ["median", "mean"])
def test_pairing_narrows_the_interval_when_rounds_drift_together(stat):
    rng = np.random.default_rng(3)
    rounds = rng.lognormal(0, 0.5, 30)  # each round's machine: slow or fast for everyone in it
    a, a_again = rounds * rng.lognormal(0, 0.05, 30), rounds * rng.lognormal(0, 0.05, 30)
    b = 1.1 * rounds * rng.lognormal(0, 0.05, 30)
    unpaired, paired = (ratio_interval(a, b, stat, paired=p, **FAST) for p in (False, True))
    assert paired.high - paired.low < 0.6 * (unpaired.high - unpaired.low)
    if stat == "mean":  # the drift cancels: 10 % shows, where unpaired it drowns
        assert verdict(a, b, noise_band(a, a_again, stat, paired=True, **FAST), stat=stat, paired=True,
                       **FAST).word == "higher"
        assert verdict(a, b, noise_band(a, a_again, stat, **FAST), stat=stat, **FAST).word == "level"


def test_the_phrase_gives_the_factor_its_interval_the_counts_and_the_band():
    band = Band(0.92, 1.09, 24)
    up = Verdict("higher", 1, Interval(1.31, 1.18, 1.45, 24, 24), band)
    assert str(up) == "1.31x higher (95 % interval 1.18-1.45x, n = 24 vs 24; A/A band 0.92-1.09x)"
    down = Verdict("faster", -1, Interval(0.5, 0.45, 0.55, 24, 30), Band(0.8, 1.25, 24))
    assert down.describe() == "2.00x faster (95 % interval 1.82-2.22x, n = 24 vs 30; A/A band 0.80-1.25x)"
    inside = Verdict("level", 0, Interval(0.97, 0.93, 1.05, 24, 24), band)
    assert str(inside) == "level (0.97x, 95 % interval 0.93-1.05x within the A/A band 0.92-1.09x, n = 24 vs 24)"
    across = Verdict("level", 0, Interval(1.1, 1.02, 1.2, 24, 24), band)
    assert "overlapping the A/A band" in str(across)
    assert up.as_dict() | {"band_low": 0} == {**up.as_dict(), "band_low": 0} and up.as_dict()["low"] == 1.18


def test_the_callers_words_and_which_way_is_better():
    a, a_again, b = three_draws(1, 30, 0.1, 1.3)  # b: latencies 1.3x longer
    band = noise_band(a, a_again, **FAST)
    worse = verdict(a, b, band, higher="slower", lower="faster", higher_is_better=False, **FAST)
    assert (worse.word, worse.sign, worse.better) == ("slower", 1, False)
    better = verdict(b, a, noise_band(b, a_again * 1.3, **FAST), higher="slower", lower="faster",
                     higher_is_better=False, **FAST)
    assert (better.word, better.sign, better.better) == ("faster", -1, True)
    same = verdict(a, a_again, band, level="within noise", higher_is_better=True, **FAST)
    assert (same.word, same.better) == ("within noise", None)
    assert verdict(a, b, band, **FAST).better is None  # no direction said: no judgement


def test_bad_samples_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="at least 2 samples"):
        ratio_interval([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="b needs at least 2"):
        ratio_interval([1.0, 2.0], [])
    with pytest.raises(ValueError, match="non-finite"):
        ratio_interval([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        ratio_interval([1.0, 2.0], [1.0, float("inf")])
    with pytest.raises(ValueError, match="positive denominator"):
        ratio_interval([0.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="zero in some resamples"):
        ratio_interval([0.0, 0.0, 1.0, 1.0, 1.0], [1.0] * 5, **FAST)
    with pytest.raises(ValueError, match="same count"):
        ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0], paired=True)
    with pytest.raises(ValueError, match="stat must be"):
        ratio_interval([1.0, 2.0], [1.0, 2.0], stat="p99")


def recording(calls: list, value):
    def run():
        calls.append(run.name)
        return value() if callable(value) else value
    return run


def test_interleaved_rotates_the_order_and_runs_the_repeat_twice_a_round():
    calls = []
    runs = {name: recording(calls, v) for name, v in (("A", 1.0), ("B", [2.0, 2.5]), ("C", 3.0))}
    for name, run in runs.items():
        run.name = name
    exp = interleaved(runs, rounds=4, warmup=1, progress=False)
    assert len(calls) == 5 * 4 and calls.count("A") == 2 * 5  # the warm-up round ran, A twice in every round
    firsts = [order[0] for order in exp.order]
    assert len(set(firsts)) == 4, exp.order  # four rounds, four different configurations first
    assert all(sorted(order) == sorted(["A", "A" + AGAIN, "B", "C"]) for order in exp.order)
    s = exp.samples
    assert {k: len(v) for k, v in s.items()} == {"A": 4, "A" + AGAIN: 4, "B": 8, "C": 4}  # warm-up dropped
    assert exp.per_round["B"] == [[2.0, 2.5]] * 4 and s["B"][:4] == [2.0, 2.5, 2.0, 2.5]
    with pytest.raises(ValueError, match="is not one of the runs"):
        interleaved(runs, rounds=2, repeat="D", progress=False)
    with pytest.raises(ValueError, match="at least 2 rounds"):
        interleaved(runs, rounds=1, progress=False)


def test_the_repeat_runs_about_half_a_round_from_its_first_run():
    calls = []
    runs = {name: recording(calls, 1.0) for name in "ABCD"}
    for name, run in runs.items():
        run.name = name
    exp = interleaved(runs, rounds=5, repeat="B", progress=False)
    first = exp.order[0]
    assert first[0] == "B" and abs(first.index("B" + AGAIN) - first.index("B")) == 3  # B, A, C, B again, D


def test_an_interleaved_experiment_reads_a_planted_slowdown_against_its_own_band():
    rng = np.random.default_rng(5)
    mood = rng.lognormal(0, 0.3, 30)  # the machine's speed in each round, shared by every run in it
    calls = []

    def run(factor):  # four runs a round (ours twice), the same four requests each: pairs by position
        calls.append(factor)
        return list(factor * mood[(len(calls) - 1) // 4] * np.array([1.0, 2.0, 4.0, 8.0]) * rng.lognormal(0, 0.05))

    runs = {"ours": lambda: run(1.0), "slower": lambda: run(1.3), "same": lambda: run(1.0)}
    exp = interleaved(runs, rounds=30, progress=False)
    band = exp.band(**FAST)
    assert band.low <= 1.0 <= band.high and band.n == 120
    slow = exp.compare("ours", "slower", higher="slower", lower="faster", higher_is_better=False, **FAST)
    assert (slow.word, slow.better, slow.n_a, slow.n_b) == ("slower", False, 120, 120)
    assert exp.compare("ours", "slower", paired=False, **FAST).word == "level"  # unpaired, rounds and requests drown it
    assert exp.compare("ours", "same", stat="mean", **FAST).word == "level"


def test_a_figure_carries_its_n_and_a_short_tail_is_called_the_max():
    assert with_n(123.44, 40, "ms") == "123.4 ms (n = 40)"
    assert with_n(0.5, 1200, spec=".0%") == "50% (n = 1,200)"
    assert tail_with_n(list(range(40))) == "max 39 ms (n = 40)"
    assert tail_with_n([float(x) for x in range(101)]) == "P99 99 ms (n = 101)"
    assert median_and_tail([1.0, 2.0, 9.0], unit="s", spec=".1f") == "median 2.0 s, max 9.0 s (n = 3)"


def test_a_ratio_beyond_the_band_is_level_while_its_interval_reaches_into_it():
    a, _, b = three_draws(2, 30, 0.2, 1.15)
    band = Band(0.95, 1.05, 30)
    v = verdict(a, b, band, **FAST)
    assert v.ratio > band.high and v.interval.low < band.high  # the point says "higher", the interval does not
    assert (v.word, v.sign) == ("level", 0)
    assert verdict(a, b, Band(0.5, 0.6, 30), **FAST).word == "higher"  # the same interval against a band below it


def test_trend_finds_a_growing_series_and_calls_a_flat_one_level():
    rng = np.random.default_rng(3)
    growing = [10 + 0.1 * i + rng.normal(0, 0.5) for i in range(128)]
    flat = [10 + rng.normal(0, 0.5) for _ in range(128)]
    assert trend(growing, n_resamples=500).word == "higher"
    assert trend(flat, n_resamples=500).word == "level"
    assert trend(growing[::-1], n_resamples=500).word == "lower"
    with pytest.raises(ValueError, match="at least 16 samples"):
        trend(growing[:12])


def test_one_run_each_gives_the_ratio_and_no_verdict_word():
    assert one_run_each(3.0, 2.0) == "1.50x (one run each: no verdict)"
    assert one_run_each(1.0, 4.0, "one request each") == "0.25x (one request each: no verdict)"
    assert one_run_each(0.0, 2.0).startswith("no ratio")


def test_share_interval_is_exact_and_narrows_with_more_requests():
    from labsupport.measure import share_interval
    few, many = share_interval(6, 8), share_interval(150, 200)
    assert few.value == 0.75 and many.value == 0.75
    assert few.low < many.low <= 0.75 <= many.high < few.high  # same share, 25x the requests: a narrower interval
    assert share_interval(0, 10).low == 0.0 and share_interval(10, 10).high == 1.0
    assert "75.0 % (150/200" in str(many)
    for k, n in ((3, 2), (-1, 4), (0, 0)):
        with pytest.raises(ValueError):
            share_interval(k, n)


def test_share_verdict_calls_a_difference_only_when_the_intervals_part():
    from labsupport.measure import share_interval, share_verdict
    assert share_verdict(share_interval(6, 8), share_interval(4, 8)) == "level"  # 8 requests: anything goes
    assert share_verdict(share_interval(150, 200), share_interval(100, 200)) == "lower"
    assert share_verdict(share_interval(100, 200), share_interval(150, 200), "ahead", "behind") == "ahead"
    assert share_verdict(share_interval(150, 200), share_interval(140, 200)) == "level"


def test_share_verdict_with_an_aa_pair_needs_a_gap_wider_than_the_rerun_moved():
    """Queued requests are not independent trials: where a rerun of A on other arrivals moved its share as far as
    B differs from A, the binomial intervals parting is not enough."""
    from labsupport.measure import aa_gap, share_interval, share_verdict
    a, b = share_interval(900, 1000), share_interval(800, 1000)  # intervals part: "lower" without an A/A pair
    assert share_verdict(a, b) == "lower"
    assert share_verdict(a, b, aa=(a, share_interval(880, 1000))) == "lower"  # the rerun moved 2 points, B 10
    assert share_verdict(a, b, aa=(a, share_interval(780, 1000))) == "level"  # the rerun moved 12 points
    assert share_verdict(share_interval(6, 8), share_interval(4, 8), aa=(a, a)) == "level"  # intervals must part too
    assert aa_gap((a, share_interval(880, 1000))) == "A/A gap 2.0 points (n 1,000 and 1,000)"


def test_goodput_rate_is_the_highest_rate_before_the_first_miss():
    from labsupport.measure import goodput_rate, share_interval
    shares = [share_interval(k, 100) for k in (99, 95, 80, 97)]  # the last rate meets 90 % again: not counted
    assert goodput_rate([1, 2, 4, 8], shares) == 2
    assert goodput_rate([1, 2], [share_interval(50, 100), share_interval(99, 100)]) is None  # not even the lowest
    assert goodput_rate([1, 2], shares[:2], target=0.97) == 1


def bursts(rng, runs: int, shift: float = 1.0, n: int = 8, sigma_run: float = 0.1, sigma_request: float = 0.005):
    """``runs`` bursts of ``n`` requests sent at once: the requests of one burst share its steps, so they move
    together (a run-wide factor of ``sigma_run``) and differ little among themselves (``sigma_request``)."""
    return [list(shift * rng.lognormal(0, sigma_run) * rng.lognormal(0, sigma_request, n)) for _ in range(runs)]


def joined(runs):
    return [x for run in runs for x in run]


def test_one_burst_a_side_reads_chance_as_a_difference_and_runs_as_the_unit_do_not():
    by_sample, by_run = [], []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        one = [joined(bursts(rng, 1)) for _ in range(3)]  # A, A again, B: one burst each, one distribution
        by_sample.append(word(*one, seed, paired=True))
        a, a_again, b = (bursts(rng, MIN_RUNS) for _ in range(3))
        band = noise_band(a, a_again, by="run", paired=True, seed=seed, **FAST)
        by_run.append(verdict(a, b, band, by="run", paired=True, seed=seed, **FAST).word)
    # requests that move together look like 8 independent samples: the band is far too narrow, chance "wins"
    assert len(by_sample) - by_sample.count("level") >= 16, by_sample
    assert by_run.count("level") >= 38, by_run


def test_runs_as_the_unit_find_a_planted_difference_between_bursts_both_ways():
    found = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        a, a_again, slower, faster = (bursts(rng, 4), bursts(rng, 4), bursts(rng, 4, 1.6), bursts(rng, 4, 1 / 1.6))
        band = noise_band(a, a_again, by="run", paired=True, seed=seed, **FAST)
        assert band.runs == 4 and band.n == 32 and band.low <= 1.0 <= band.high
        found.append((verdict(a, slower, band, by="run", paired=True, seed=seed, **FAST).word,
                      verdict(a, faster, band, by="run", paired=True, seed=seed, **FAST).word))
    assert sum(f == ("higher", "lower") for f in found) >= 16, found


def test_an_interval_over_runs_holds_the_pooled_ratio_and_counts_runs_of_any_length():
    a = [[1.0, 1.1, 0.9], [1.2, 1.0], [0.8, 1.0, 1.1, 0.9]]
    b = [[2.0, 2.2], [2.4, 1.8, 2.0], [2.1, 1.9, 2.0]]
    iv = ratio_interval(a, b, stat="mean", by="run", **FAST)
    assert iv.ratio == pytest.approx(np.mean(joined(b)) / np.mean(joined(a)))
    assert (iv.n_a, iv.n_b, iv.runs_a, iv.runs_b) == (9, 8, 3, 3) and iv.low <= iv.ratio <= iv.high
    assert "n = 9 vs 8 in 3 vs 3 runs" in str(iv)
    assert ratio_interval(a, b, by="run", seed=3, **FAST) == ratio_interval(a, b, by="run", seed=3, **FAST)
    every_run_alike = ratio_interval([[1.0, 2.0]] * 3, [[2.0, 4.0]] * 3, stat="mean", by="run", paired=True, **FAST)
    assert every_run_alike.low < 2.0 < every_run_alike.high  # requests are still drawn within each run
    tenth = ratio_interval(a, b, stat=lambda x: np.percentile(x, 90), by="run", **FAST)
    assert tenth.ratio == pytest.approx(np.percentile(joined(b), 90) / np.percentile(joined(a), 90))
    band = noise_band(a, b, by="run", **FAST)
    assert band.runs == 3 and "in 3 runs" in str(band)
    v = verdict(a, b, Band(0.8, 1.25, 8, runs=3), by="run", **FAST)
    assert v.word == "higher" and "in 3 vs 3 runs" in str(v) and v.as_dict()["runs_a"] == 3


def test_runs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match=f"at least {MIN_RUNS} runs"):
        ratio_interval([[1.0, 2.0], [1.0]], [[1.0], [2.0], [3.0]], by="run")
    with pytest.raises(ValueError, match="at least one sample"):
        ratio_interval([[1.0], [], [2.0]], [[1.0], [2.0], [3.0]], by="run")
    with pytest.raises(ValueError, match="non-finite"):
        ratio_interval([[1.0], [float("nan")], [2.0]], [[1.0], [2.0], [3.0]], by="run")
    with pytest.raises(ValueError, match="same count"):
        ratio_interval([[1.0]] * 3, [[1.0]] * 4, by="run", paired=True)
    with pytest.raises(ValueError, match="by must be"):
        ratio_interval([1.0, 2.0], [1.0, 2.0], by="round")
    with pytest.raises(ValueError, match="same unit"):  # a band over samples read against runs, or the reverse
        verdict([[1.0]] * 3, [[2.0]] * 3, Band(0.9, 1.1, 3), by="run")
    with pytest.raises(ValueError, match="same unit"):
        verdict([1.0, 2.0], [2.0, 3.0], Band(0.9, 1.1, 3, runs=3))


def test_an_experiment_of_whole_results_reads_each_figure_by_run():
    rng = np.random.default_rng(11)

    def burst(shift):  # a benchmark's whole run: several figures per request
        (ttft,) = bursts(rng, 1, shift)
        return {"ttft": ttft, "tpot": [t / 10 for t in ttft]}

    exp = interleaved({"async": lambda: burst(1.0), "lock": lambda: burst(3.0)}, rounds=4, repeat="async",
                      progress=False)
    assert exp.per_round["lock"] == [[]] * 4 and len(exp.results["async" + AGAIN]) == 4
    ttft = exp.figures(lambda run: run["ttft"])
    assert [len(r) for r in ttft.per_round["lock"]] == [8] * 4
    v = ttft.compare("lock", "async", by="run", higher="slower", lower="faster", **FAST)
    assert v.word == "faster" and (v.interval.runs_a, v.band.runs) == (4, 4)
    assert exp.figures(lambda run: run["tpot"]).compare("async", "async" + AGAIN, by="run", **FAST).word == "level"
    with pytest.raises(ValueError, match="kept no results"):
        type(exp)({"a": [[1.0]]}, [["a"]], "a").figures(len)


def test_runs_weigh_by_their_length_and_pairing_by_round_cancels_what_a_round_shares():
    # a run of one slow sample and a run of nine quick ones: pooled, the quick ones outnumber it
    weighed = ratio_interval([[10.0], [1.0] * 9, [1.0] * 9], [[1.0]] * 3, stat="mean", by="run", **FAST)
    assert weighed.ratio == pytest.approx(1.0 / (28.0 / 19)) and (weighed.n_a, weighed.n_b) == (19, 3)
    rng = np.random.default_rng(2)
    mood = rng.lognormal(0, 0.4, 6)  # each round's machine speed, shared by both sides of that round
    a = [list(m * rng.lognormal(0, 0.01, 8)) for m in mood]
    b = [list(1.2 * m * rng.lognormal(0, 0.01, 8)) for m in mood]
    paired = ratio_interval(a, b, by="run", paired=True, **FAST)
    unpaired = ratio_interval(a, b, by="run", paired=False, **FAST)
    assert paired.low < 1.2 < paired.high and paired.high - paired.low < (unpaired.high - unpaired.low) / 3


def test_an_experiment_refuses_lost_samples_and_names_what_to_do():
    with pytest.raises(ValueError, match="returned None"):
        interleaved({"a": lambda: None, "b": lambda: 1.0}, rounds=2, progress=False)
    with pytest.raises(ValueError, match="not all numbers"):  # a failed request's None among the samples
        interleaved({"a": lambda: [1.0, None], "b": lambda: [1.0, 2.0]}, rounds=2, progress=False)
    whole = interleaved({"a": lambda: {"x": [1.0, 2.0]}, "b": lambda: {"x": [2.0, 3.0]}}, rounds=3, progress=False)
    with pytest.raises(ValueError, match="figures"):
        whole.compare("a", "b", **FAST)
    with pytest.raises(ValueError, match="flat list"):
        ratio_interval([1.0, 2.0, 3.0], [[1.0], [2.0], [3.0]], by="run")
