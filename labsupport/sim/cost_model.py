"""What one engine step costs: a few features of the batch, and a linear model of seconds fitted to them.

A step's time is modelled as ``c · features``, each feature a count the scheduler already knows before
the step runs (Vidur, MLSys'24, splits a step the same way):

- ``step``: 1. What every step pays whatever it holds: reading the weights once, launching kernels, the
  scheduler's own Python (folded in here, not modelled apart).
- ``prefill_tokens``: tokens fed by rows feeding more than one token (a prompt or a chunk of one, a
  sequence recomputed after preemption, a decode row with speculative guesses: every fed token costs its
  products whatever it is).
- ``attention_pairs``: for those rows, the (query token, key token) pairs attention computes: a row
  feeding ``n`` tokens after ``s`` computed ones has ``n*s + n*(n+1)/2``.
- ``decode_rows``: sequences feeding exactly one token (their products, sampling, one row of logits).
- ``context_tokens``: for decode rows, the tokens whose K/V each reads (``s + 1``): decode attention is
  bound by reading the cache.

The coefficients are non-negative (a token never makes a step quicker), fitted by least squares on
relative error, so the many short decode steps count as much as the few long prefills.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FEATURES = ("step", "prefill_tokens", "attention_pairs", "decode_rows", "context_tokens")


def features_of(starts: list[int], fed: list[int]) -> dict[str, int]:
    """The features of a step whose rows start after ``starts[i]`` computed tokens and feed ``fed[i]``."""
    f = dict.fromkeys(FEATURES, 0)
    f["step"] = 1
    for s, n in zip(starts, fed):
        if n <= 0:
            continue
        if n == 1:
            f["decode_rows"] += 1
            f["context_tokens"] += s + 1
        else:
            f["prefill_tokens"] += n
            f["attention_pairs"] += n * s + n * (n + 1) // 2
    return f


def step_features(batch) -> dict[str, int]:
    """The features of a scheduled step (a ``SchedulerOutput``), read before it runs: each request's
    ``num_computed_tokens`` is where its row starts."""
    return features_of([r.num_computed_tokens for r in batch.requests], list(batch.num_new_tokens))


@dataclass
class StepCostModel:
    """Seconds of a step = sum of coefficient x feature (features missing from ``coefficients`` cost 0)."""

    coefficients: dict[str, float]

    def predict(self, features: dict) -> float:
        return sum(c * features.get(name, 0) for name, c in self.coefficients.items())

    def to_dict(self) -> dict:
        return {name: float(self.coefficients.get(name, 0.0)) for name in FEATURES}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostModel":
        unknown = set(d) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-cost features {sorted(unknown)}: the model knows {FEATURES}")
        return cls({name: float(d.get(name, 0.0)) for name in FEATURES})


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares: scipy's where installed, else least squares refitted without the
    columns that came out negative until none does (exact when the active set settles, as it does here)."""
    try:
        from scipy.optimize import nnls
        return nnls(a, b)[0]
    except ImportError:
        pass
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (sol >= 0).all():
            x[active] = sol
            break
        active = [j for j, v in zip(active, sol) if v > 0]
    return x


def fit(records: list[dict]) -> tuple[StepCostModel, dict]:
    """Fit a ``StepCostModel`` to step records (dicts with the ``FEATURES`` and ``duration_s``).

    Each row is divided by its duration, so the fit minimizes relative error: a 1 ms decode step mispredicted
    by 1 ms weighs as much as a 1 s prefill mispredicted by 1 s. Features that never vary from zero in the
    records get coefficient 0. Returns the model and a report: ``n_steps``, the median and P90 of
    ``|predicted - measured| / measured``."""
    rows = [r for r in records if r["duration_s"] > 0]
    if len(rows) < len(FEATURES):
        raise ValueError(f"{len(rows)} step records with a positive duration: need at least {len(FEATURES)}")
    x = np.array([[float(r[name]) for name in FEATURES] for r in rows])
    y = np.array([float(r["duration_s"]) for r in rows])
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0  # a feature never seen: its column stays zero, its coefficient 0
    coef = _nnls(x / scale / y[:, None], np.ones(len(y))) / scale  # columns scaled: condition, not result
    model = StepCostModel(dict(zip(FEATURES, coef.tolist())))
    err = np.abs(x @ coef - y) / y
    report = {"n_steps": len(rows), "median_abs_rel_error": float(np.median(err)),
              "p90_abs_rel_error": float(np.percentile(err, 90))}
    return model, report
