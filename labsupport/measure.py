"""How the course turns measurements into words: a ratio with its interval, read against a measured noise band.

On a shared machine the same work run twice does not take the same time, so a difference is a difference only
when it is larger than what running the *same* configuration twice shows. The discipline, in four steps:

1. Interleave: run the configurations round by round, in an order that rotates each round, so that a slow
   minute of the machine falls on all of them alike (``interleaved``).
2. Run one configuration twice in every round ("A" and "A (again)"): the ratio of those two (A/A), with its
   bootstrap interval, is this experiment's noise band (``noise_band``); it always contains 1.
3. Compare B against A as a ratio, stat(B) / stat(A), with a bootstrap interval (``ratio_interval``).
4. Say "higher" or "lower" (or the caller's words) only when that whole interval lies outside the band, else
   "level" (``verdict``); print every figure with its n (``with_n``), and call a tail from fewer than
   ``percentiles.MIN_P99_SAMPLES`` samples the max (``tail_with_n``).

The bootstrap resamples the unit that chance acts on. Requests sent one by one each meet the machine afresh, so
by default a sample is the unit. Requests sent all at once share their engine steps and move together: two runs
of one burst can look alike request by request while the next burst runs 20 % slower, and a band bootstrapped
over requests then reads far narrower than runs differ. For such loads pass ``by="run"``, give each side its
runs (at least ``MIN_RUNS``), and the bootstrap draws runs first, then requests within each drawn run.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from scipy.stats import bootstrap
from tqdm.auto import tqdm

from .percentiles import tail_of

CONFIDENCE = 0.95
N_RESAMPLES = 4000  # enough that the interval's ends barely move from seed to seed; tests may use fewer
MAX_RESAMPLED_VALUES = 4_000_000  # per bootstrap batch: bounds memory for runs of many thousands of samples
STATS = {"median": np.median, "mean": np.mean}
NAN_STATS = {"median": np.nanmedian, "mean": np.nanmean}  # the same, over runs of unequal length padded with nan
assert NAN_STATS.keys() == STATS.keys(), "every named statistic needs its nan-skipping form for by='run'"
# by="run": fewer runs give too few distinct resamples for an interval's ends to mean anything. A floor, not a
# guarantee: from three runs the interval cannot reach past the most extreme one, so it reads narrower than the
# noise may be; more rounds where the time allows.
MIN_RUNS = 3
AGAIN = " (again)"  # the repeated configuration's second run is recorded under its name + AGAIN


def _factor(x: float) -> str:
    """A ratio as "1.31x", "12.4x", "130x": three figures at most, never "0.00x"."""
    return f"{x:.2f}x" if abs(x) < 10 else f"{x:.1f}x" if abs(x) < 100 else f"{x:.0f}x"


def _range(low: float, high: float) -> str:
    return f"{_factor(low)[:-1]}-{_factor(high)}"


@dataclass(frozen=True)
class Interval:
    """stat(b) / stat(a) and the bootstrap interval around it, with each side's sample count."""
    ratio: float
    low: float
    high: float
    n_a: int
    n_b: int
    confidence: float = CONFIDENCE
    runs_a: int | None = None  # by="run": the runs the samples came in (the unit the bootstrap drew)
    runs_b: int | None = None

    def n_text(self) -> str:
        """"n = 24 vs 24", or "n = 24 vs 24 in 3 vs 3 runs" when runs were the unit."""
        runs = "" if self.runs_a is None else f" in {self.runs_a} vs {self.runs_b} runs"
        return f"n = {self.n_a:,} vs {self.n_b:,}{runs}"

    def __str__(self) -> str:
        return f"{_factor(self.ratio)} ({100 * self.confidence:.0f} % interval {_range(self.low, self.high)}, {self.n_text()})"


@dataclass(frozen=True)
class Band:
    """The ratios the same configuration run twice can show by chance: the A/A interval, widened to hold 1."""
    low: float
    high: float
    n: int  # samples on each side of the A/A comparison (the fewer, if they differ)
    runs: int | None = None  # by="run": runs on each side (the fewer)

    def __contains__(self, ratio: float) -> bool:
        return self.low <= ratio <= self.high

    def __str__(self) -> str:
        runs = "" if self.runs is None else f" in {self.runs} runs"
        return f"A/A band {_range(self.low, self.high)} (n = {self.n:,}{runs})"


def _values(xs: Iterable[float], side: str) -> np.ndarray:
    v = np.asarray(list(xs), dtype=float)
    if v.ndim != 1 or len(v) < 2:
        raise ValueError(f"{side} needs at least 2 samples for an interval, got {v.size}")
    if not np.isfinite(v).all():
        raise ValueError(f"{side} holds non-finite values (nan or inf): drop failed runs before comparing")
    return v


def _statistic(stat: str | Callable) -> tuple[Callable, bool]:
    """(the statistic, whether it takes ``axis=``): named ones run vectorized over every resample at once."""
    if callable(stat):
        return stat, False
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)} or a function of a sample, not {stat!r}")
    return STATS[stat], True


def _positive_denominator(stat, value: float) -> None:
    if not value > 0:
        name = stat if isinstance(stat, str) else getattr(stat, "__name__", "stat")
        raise ValueError(f"the {name} of a is {value}: a ratio needs a positive denominator")


def _runs(runs, side: str) -> tuple[np.ndarray, np.ndarray]:
    """Runs of samples as a (runs, longest) matrix padded with nan, and each run's length."""
    runs = list(runs)
    if any(isinstance(r, (int, float, np.number)) for r in runs):
        raise ValueError(f'{side}: by="run" takes a list of runs, each a list of samples, not a flat list of numbers')
    rows = [np.asarray(list(r), dtype=float) for r in runs]
    if len(rows) < MIN_RUNS:
        raise ValueError(f"{side} needs at least {MIN_RUNS} runs for an interval over runs, got {len(rows)}")
    if any(r.ndim != 1 or r.size == 0 for r in rows):
        raise ValueError(f"{side}: every run needs at least one sample (a list of floats per run)")
    if not all(np.isfinite(r).all() for r in rows):
        raise ValueError(f"{side} holds non-finite values (nan or inf): drop failed runs before comparing")
    m = np.full((len(rows), max(r.size for r in rows)), np.nan)
    for i, r in enumerate(rows):
        m[i, :r.size] = r
    return m, np.array([r.size for r in rows])


def _two_stage(m: np.ndarray, lengths: np.ndarray, picks: np.ndarray, stat: Callable, rng) -> np.ndarray:
    """stat of each resample: ``picks`` (resamples, runs) names the runs drawn; within each, its samples are drawn
    again with replacement (positions past a run's length stay nan, which the nan-stat skips)."""
    width = m.shape[1]
    chosen = lengths[picks][..., None]                                    # (resamples, runs, 1)
    within = np.minimum((rng.random((*picks.shape, width)) * chosen).astype(int), chosen - 1)
    values = m[picks[..., None], within]
    values = np.where(np.arange(width) < chosen, values, np.nan).reshape(len(picks), -1)
    return stat(values, axis=1)


def _run_ratio_interval(a, b, stat, confidence, n_resamples, seed, paired) -> Interval:
    """``ratio_interval`` with runs as the unit: draw runs (the same round indexes on both sides when paired),
    then samples within each drawn run."""
    (ma, la), (mb, lb) = _runs(a, "a"), _runs(b, "b")
    if paired and len(la) != len(lb):
        raise ValueError(f"paired runs need the same count on both sides, got {len(la)} and {len(lb)}")
    fn, vectorized = _statistic(stat)
    if vectorized:
        nan_fn = NAN_STATS[stat]
    else:
        def nan_fn(v, axis):
            return np.array([fn(row[np.isfinite(row)]) for row in v])
    name = stat if isinstance(stat, str) else getattr(stat, "__name__", "stat")
    whole_a, whole_b = ma[np.isfinite(ma)], mb[np.isfinite(mb)]
    _positive_denominator(stat, fn(whole_a))
    rng = np.random.default_rng(seed)
    batch = max(1, MAX_RESAMPLED_VALUES // (ma.size + mb.size))
    ratios = []
    for start in range(0, n_resamples, batch):
        k = min(batch, n_resamples - start)
        pick_a = rng.integers(0, len(la), (k, len(la)))
        pick_b = pick_a if paired else rng.integers(0, len(lb), (k, len(lb)))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios.append(_two_stage(mb, lb, pick_b, nan_fn, rng) / _two_stage(ma, la, pick_a, nan_fn, rng))
    ratios = np.concatenate(ratios)
    if not np.isfinite(ratios).all():
        raise ValueError(f"the {name} of a was zero in some resamples (too few nonzero samples): "
                         "compare another statistic (stat='mean') or take more samples")
    low, high = np.quantile(ratios, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Interval(float(fn(whole_b) / fn(whole_a)), float(low), float(high), whole_a.size, whole_b.size,
                    confidence, len(la), len(lb))


def ratio_interval(a: Iterable[float], b: Iterable[float], stat: str | Callable = "median",
                   confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = 0,
                   paired: bool = False, by: str = "sample") -> Interval:
    """stat(b) / stat(a) with a percentile bootstrap interval. Unpaired, each side is resampled on its own; paired,
    the pairs (a[i], b[i]) are resampled together, for samples measured side by side (round i of an interleaved
    run): what made both slow in one round then cancels out of the ratio. The same seed gives the same interval.

    ``by="run"``: ``a`` and ``b`` are lists of runs (each a list of samples, at least ``MIN_RUNS`` a side) and
    the bootstrap draws runs, then samples within them (paired: run i of each side together), so the interval
    holds what changes from run to run, not only from request to request."""
    if by == "run":
        return _run_ratio_interval(a, b, stat, confidence, n_resamples, seed, paired)
    if by != "sample":
        raise ValueError(f'by must be "sample" or "run", not {by!r}')
    a, b = _values(a, "a"), _values(b, "b")
    if paired and len(a) != len(b):
        raise ValueError(f"paired samples need the same count on both sides, got {len(a)} and {len(b)} "
                         "(paired=False for samples not measured side by side)")
    fn, vectorized = _statistic(stat)
    name = stat if isinstance(stat, str) else getattr(stat, "__name__", "stat")
    _positive_denominator(stat, fn(a))
    if vectorized:
        def ratio(x, y, axis=-1):
            return fn(y, axis=axis) / fn(x, axis=axis)
    else:
        def ratio(x, y):
            return fn(y) / fn(x)
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample's zero denominator is caught below
        res = bootstrap((a, b), ratio, n_resamples=n_resamples, paired=paired, vectorized=vectorized,
                        confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed),
                        batch=max(1, MAX_RESAMPLED_VALUES // (len(a) + len(b))))
    low, high = res.confidence_interval
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"the {name} of a was zero in some resamples (too few nonzero samples): "
                         "compare another statistic (stat='mean') or take more samples")
    return Interval(float(fn(b) / fn(a)), float(low), float(high), len(a), len(b), confidence)


def noise_band(a: Iterable[float], a_again: Iterable[float], stat: str | Callable = "median",
               confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = 0,
               paired: bool = False, by: str = "sample") -> Band:
    """The interval of a_again / a (the same configuration measured twice), widened to contain 1.0: a ratio
    inside it is one chance alone can produce in this experiment. ``by="run"``: lists of runs, as in
    ``ratio_interval``."""
    iv = ratio_interval(a, a_again, stat, confidence, n_resamples, seed, paired, by)
    runs = None if iv.runs_a is None else min(iv.runs_a, iv.runs_b)
    return Band(min(iv.low, 1.0), max(iv.high, 1.0), min(iv.n_a, iv.n_b), runs)


@dataclass(frozen=True)
class Verdict:
    """One comparison's word, with the figures that justify it. ``str(v)`` is a phrase to put in a sentence."""
    word: str
    sign: int  # +1: the interval lies above the band, -1: below it, 0: level
    interval: Interval
    band: Band
    higher_is_better: bool | None = None

    @property
    def ratio(self) -> float:
        return self.interval.ratio

    @property
    def n_a(self) -> int:
        return self.interval.n_a

    @property
    def n_b(self) -> int:
        return self.interval.n_b

    @property
    def better(self) -> bool | None:
        """True when b moved the better way beyond the noise, False when the worse way, None when level (or when
        the caller did not say which way is better)."""
        if self.sign == 0 or self.higher_is_better is None:
            return None
        return (self.sign > 0) == self.higher_is_better

    def describe(self) -> str:
        """"1.31x higher (95 % interval 1.18-1.45x, n = 24 vs 24; A/A band 0.92-1.09x)". A move down is given as
        a/b ("2.00x faster" rather than "0.50x faster"), its interval and band turned over to the same scale."""
        iv, band, conf = self.interval, self.band, f"{100 * self.interval.confidence:.0f} % interval"
        n = iv.n_text()
        if self.sign == 0:
            where = "within" if iv.low >= band.low and iv.high <= band.high else "overlapping"
            return (f"{self.word} ({_factor(iv.ratio)}, {conf} {_range(iv.low, iv.high)} {where} the A/A band "
                    f"{_range(band.low, band.high)}, {n})")
        if self.sign > 0:
            x, lo, hi, b_lo, b_hi = iv.ratio, iv.low, iv.high, band.low, band.high
        else:
            x, lo, hi, b_lo, b_hi = 1 / iv.ratio, 1 / iv.high, 1 / iv.low, 1 / band.high, 1 / band.low
        return f"{_factor(x)} {self.word} ({conf} {_range(lo, hi)}, {n}; A/A band {_range(b_lo, b_hi)})"

    __str__ = describe

    def as_dict(self) -> dict:
        """The verdict as plain numbers, for a saved run's JSON."""
        iv = self.interval
        return {"word": self.word, "sign": self.sign, "ratio": iv.ratio, "low": iv.low, "high": iv.high,
                "confidence": iv.confidence, "n_a": iv.n_a, "n_b": iv.n_b, "runs_a": iv.runs_a, "runs_b": iv.runs_b,
                "band_low": self.band.low, "band_high": self.band.high, "band_n": self.band.n,
                "band_runs": self.band.runs}


def verdict(a: Iterable[float], b: Iterable[float], band: Band, higher: str = "higher", lower: str = "lower",
            level: str = "level", higher_is_better: bool | None = None, stat: str | Callable = "median",
            confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = 0,
            paired: bool = False, by: str = "sample") -> Verdict:
    """``higher`` when the whole interval of stat(b)/stat(a) lies above ``band``, ``lower`` when below, else
    ``level``. Name the words for the metric: for latencies ``higher="slower", lower="faster"``; for a technique's
    throughput ``higher="pays", lower="costs"``. Measure the band with the same stat, pairing and unit (``by``)."""
    if (by == "run") != (band.runs is not None):
        raise ValueError(f"the band was measured by {'run' if band.runs is not None else 'sample'}, "
                         f"the comparison by {by}: measure both with the same unit")
    iv = ratio_interval(a, b, stat, confidence, n_resamples, seed, paired, by)
    sign = 1 if iv.low > band.high else -1 if iv.high < band.low else 0
    return Verdict({1: higher, -1: lower, 0: level}[sign], sign, iv, band, higher_is_better)


def trend(values: Iterable[float], part: int = 4, higher: str = "higher", lower: str = "lower",
          level: str = "level", **options) -> Verdict:
    """Does a series move from its start to its end? Its last ``1/part`` against its first (medians), read against
    an A/A band from the first part split into two interleaved halves (its even and odd samples: the same
    condition, measured alternately). For a series measured in one run, such as the latency of each token against
    its position; a drift of the whole machine between runs is not in this band, so compare runs with
    ``interleaved``."""
    v = list(values)
    k = len(v) // part
    if k < 4:
        raise ValueError(f"a trend needs at least {4 * part} samples ({part} parts of 4), got {len(v)}")
    first, last = v[:k], v[-k:]
    band = noise_band(first[0::2], first[1::2], **options)
    return verdict(first, last, band, higher=higher, lower=lower, level=level, **options)


def rotated_order(names: list[str], repeat: str) -> list[str]:
    """One round's order before rotation: ``repeat`` first and its second run about half way round the cycle, so
    that, rotated, the A/A pair sits as far apart in time as the configurations it judges."""
    rest = [n for n in names if n != repeat]
    k = (len(rest) + 1) // 2
    return [repeat, *rest[:k], repeat + AGAIN, *rest[k:]]


@dataclass
class Experiment:
    """Every sample of an interleaved run by configuration name (``repeat + AGAIN`` for the A/A run).

    ``per_round[name][r]`` holds what round r's call returned; ``samples[name]`` is those lists joined in round
    order. So when each call returns one float, sample r of every configuration comes from round r, and when
    each returns the same number of values (one per request of a fixed workload), sample k of round r is the
    same request everywhere: ``paired=True`` pairs exactly those. A call may instead return a whole result, a
    dict or any object that is not iterable (a benchmark's run): ``results[name][r]`` keeps it, and
    ``figures(fn)`` reads samples out of it.
    """
    per_round: dict[str, list[list[float]]]
    order: list[list[str]]  # the call order of each round, as run
    repeat: str
    results: dict[str, list[object]] | None = None  # what each call returned, as it returned it

    @property
    def samples(self) -> dict[str, list[float]]:
        return {name: [x for values in rounds for x in values] for name, rounds in self.per_round.items()}

    def figures(self, fn: Callable[[object], float | Iterable[float]]) -> "Experiment":
        """The same runs, their samples now ``fn(result)`` of each call's result: one experiment, several
        figures (TTFT, TPOT, ...) read from the same interleaved runs."""
        if self.results is None:
            raise ValueError("this experiment kept no results (made by hand): build it with interleaved()")
        per_round = {name: [_as_list(fn(x)) for x in xs] for name, xs in self.results.items()}
        return Experiment(per_round, self.order, self.repeat, self.results)

    def band(self, stat: str | Callable = "median", paired: bool = True, by: str = "sample", **kw) -> Band:
        """This experiment's noise: the repeated configuration against its own second run. ``by="run"``: each
        round's call is one run, the unit the bootstrap draws (for loads sent all at once)."""
        a, a_again = self._sides(self.repeat, self.repeat + AGAIN, by)
        return noise_band(a, a_again, stat, paired=paired, by=by, **kw)

    def compare(self, a: str, b: str, stat: str | Callable = "median", paired: bool = True, by: str = "sample",
                **words) -> Verdict:
        """``verdict`` of configuration ``b`` against ``a``, read against this experiment's band (same stat,
        pairing and unit). ``words``: ``higher``, ``lower``, ``level``, ``higher_is_better``, and ``verdict``'s
        options."""
        options = {k: words.pop(k) for k in ("confidence", "n_resamples", "seed") if k in words}
        band = self.band(stat, paired, by, **options)
        x, y = self._sides(a, b, by)
        return verdict(x, y, band, stat=stat, paired=paired, by=by, **options, **words)

    def _sides(self, a: str, b: str, by: str):
        for name in (a, b):
            if name not in self.per_round:
                raise ValueError(f"{name!r} is not one of this experiment's runs {list(self.per_round)}")
            if not any(self.per_round[name]):
                raise ValueError(f"{name!r} kept whole results, no samples: read them with figures(fn) first")
        if by == "run":
            return self.per_round[a], self.per_round[b]
        s = self.samples
        return s[a], s[b]


def _as_list(out) -> list[float]:
    return [float(x) for x in out] if isinstance(out, Iterable) else [float(out)]


def _samples_or_none(out) -> list[float]:
    """A call's samples, or [] for a whole result (a benchmark's run, a dict) to read later with ``figures``.
    Numbers and lists of them must convert: a None or a failed request's None among them is an error here, not
    a sample silently gone."""
    if out is None:
        raise ValueError("a run returned None: return its samples (a float or a list) or its whole result")
    if isinstance(out, (int, float, np.number)) or (isinstance(out, Iterable)
                                                   and not isinstance(out, (str, bytes, dict))):
        try:
            return _as_list(out)
        except (TypeError, ValueError) as error:
            raise ValueError(f"a run returned samples that are not all numbers (a failed request's None?): "
                             f"{error}") from error
    return []


def interleaved(runs: dict[str, Callable[[], object]], rounds: int, repeat: str | None = None,
                warmup: int = 0, progress: bool = True) -> Experiment:
    """Run every configuration once a round for ``rounds`` rounds, and ``repeat`` (default: the first) twice;
    each round's order is the previous one's rotated by one, so no configuration always goes first or last (each
    still follows the same neighbour). ``warmup`` rounds run first and are thrown away (first calls pay for caches
    and compilers). A call returns its samples (a float or a list of them) or a whole result (a dict or any
    object that is not iterable) to read with ``Experiment.figures``."""
    if rounds < 2:
        raise ValueError(f"an interval needs at least 2 rounds, got {rounds}")
    repeat = next(iter(runs)) if repeat is None else repeat
    if repeat not in runs:
        raise ValueError(f"repeat={repeat!r} is not one of the runs {list(runs)}")
    base = rotated_order(list(runs), repeat)
    per_round = {name: [] for name in base}
    results = {name: [] for name in base}
    order = []
    with tqdm(total=(warmup + rounds) * len(base), desc="interleaved", unit="run", disable=not progress) as bar:
        for r in range(warmup + rounds):
            shift = r % len(base)
            this = base[shift:] + base[:shift]
            for name in this:
                bar.set_postfix_str(name)
                out = runs[name.removesuffix(AGAIN)]()
                if r >= warmup:
                    per_round[name].append(_samples_or_none(out))
                    results[name].append(out)
                bar.update(1)
            if r >= warmup:
                order.append(this)
    return Experiment(per_round, order, repeat, results)


def one_run_each(new: float, old: float, what: str = "one run each") -> str:
    """Two figures measured once each: their ratio and no verdict, since one sample per side has no interval and no
    A/A band to be read against. "1.73x (one run each: no verdict)"."""
    if not (new > 0 and old > 0):
        return "no ratio (a zero or a missing figure)"
    return f"{_factor(new / old)} ({what}: no verdict)"


def with_n(value: float, n: int, unit: str = "", spec: str = ".1f") -> str:
    """"123.4 ms (n = 40)": a figure never without the number of samples behind it."""
    return f"{format(value, spec)}{' ' + unit if unit else ''} (n = {n:,})"


def tail_with_n(values: list[float], unit: str = "ms", spec: str = ".0f") -> str:
    """"P99 412 ms (n = 140)", or "max 388 ms (n = 40)" below ``percentiles.MIN_P99_SAMPLES`` samples."""
    label, value = tail_of(list(values))
    return f"{label} {with_n(value, len(values), unit, spec)}"


def median_and_tail(values: list[float], unit: str = "ms", spec: str = ".0f") -> str:
    """"median 120 ms, max 180 ms (n = 40)": the typical and the unlucky sample of one run, and how many."""
    label, value = tail_of(list(values))
    u = " " + unit if unit else ""
    return f"median {format(float(np.median(values)), spec)}{u}, {label} {with_n(value, len(values), unit, spec)}"


@dataclass(frozen=True)
class Share:
    """``k`` of ``n`` (requests inside an SLO, say) and the exact (Clopper-Pearson) interval of the share."""
    k: int
    n: int
    low: float
    high: float
    confidence: float = CONFIDENCE

    @property
    def value(self) -> float:
        return self.k / self.n if self.n else math.nan

    def __str__(self) -> str:
        return (f"{100 * self.value:.1f} % ({self.k:,}/{self.n:,}; {100 * self.confidence:.0f} % interval "
                f"{100 * self.low:.1f}-{100 * self.high:.1f} %)")


def share_interval(k: int, n: int, confidence: float = CONFIDENCE) -> Share:
    """A share counted over ``n`` trials with its exact binomial interval: how far chance alone could move it if
    the trials were independent. Two shares differ in this discipline only when their intervals do not overlap.
    Requests that queue together are not independent (a burst makes several miss at once), so for them the
    interval is a lower bound on the spread: rerunning with another arrival seed is the A/A that shows the rest."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"a share needs 0 <= k <= n and n >= 1, got {k}/{n}")
    from scipy.stats import binomtest
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return Share(k, n, float(ci.low), float(ci.high), confidence)


def share_verdict(a: Share, b: Share, higher: str = "higher", lower: str = "lower",
                  aa: tuple[Share, Share] | None = None) -> str:
    """``higher`` when b's whole interval lies above a's, ``lower`` when below, else ``"level"``.

    ``aa``: the same configuration as ``a`` run again with other arrivals (an A/A pair). Queued requests are not
    independent, so the binomial intervals can part where a rerun would move the share as far: with ``aa`` the
    word also needs the gap between ``a`` and ``b`` to exceed the A/A pair's own gap."""
    word = higher if b.low > a.high else lower if b.high < a.low else "level"
    if aa is not None and word != "level" and abs(b.value - a.value) <= abs(aa[0].value - aa[1].value):
        return "level"
    return word


def aa_gap(aa: tuple[Share, Share]) -> str:
    """The A/A pair's gap as text, for the sentence beside a verdict: "A/A gap 1.2 points (n 1,000 and 1,000)."""
    return f"A/A gap {100 * abs(aa[0].value - aa[1].value):.1f} points (n {aa[0].n:,} and {aa[1].n:,})"


def goodput_rate(rates: Iterable[float], shares: Iterable[Share], target: float = 0.9) -> float | None:
    """DistServe's goodput over a sweep: the highest of ``rates`` (ascending) whose share met ``target``, every lower
    rate too (None: not even the lowest). Judged on point values: where an interval straddles ``target``, the
    goodput could be the sweep's next rate either way, and the sentence beside it should say so."""
    best = None
    for rate, share in zip(rates, shares):
        if share.value < target:
            break
        best = rate
    return best
