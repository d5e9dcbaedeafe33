"""The runner that does not run the model: a token per request, and the step's modelled time on a virtual clock.

``SimRunner.execute`` has the real ``ModelRunner``'s contract (a ``SchedulerOutput`` in, a ``ModelRunnerOutput``
out, no request changed), so the engine's own loop, scheduler, KV manager and lifecycle run unchanged around
it. It reads the step's features before anything moves (``step_features``), advances the clock by the cost
model's prediction, and returns a token per request: never an end-of-sequence token for a request that ignores
EOS, so it runs to its ``max_tokens``; for the others, with ``stop_probability`` > 0, EOS with that chance at
each token, drawn from the request id and the token's index alone (the same run gives the same lengths whatever
else is batched with it).
"""
from __future__ import annotations

import random

import torch

from ..engine.outputs import ModelRunnerOutput
from ..engine.prefix_cache import CPUTier
from ..engine.sampler import Sampler
from ..engine.stopping import may_stop
from .cost_model import StepCostModel, step_features

FILLER_TOKEN = 42  # what the simulated model "says": any id that is no EOS and no stop token of the request


class VirtualClock:
    """Seconds of simulated time: read by calling it (the engine's ``clock``), moved by ``advance``."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float):
        self.now += seconds

    def jump_to(self, t: float):
        """Idle until ``t`` (never backwards)."""
        self.now = max(self.now, t)


class SimRunner:
    """A ``ModelRunner`` without a model: see the module's docstring."""

    PLUG_POINTS = {}

    def __init__(self, model: StepCostModel, clock: VirtualClock, eos_token_ids=(), stop_probability: float = 0.0,
                 seed: int = 0):
        self.model, self.clock = model, clock
        self.eos = min(eos_token_ids) if eos_token_ids else None
        self.stop_probability, self.seed = stop_probability, seed
        self.sampler = Sampler()  # the engine releases each finished request's sampler state through it
        self.busy_s = 0.0  # modelled seconds of all steps

    def execute(self, batch) -> ModelRunnerOutput:
        seconds = self.model.predict(step_features(batch))
        self.clock.advance(seconds)
        self.busy_s += seconds
        return ModelRunnerOutput([self.token(req) for req in batch.requests])

    def token(self, req) -> int:
        p = req.params
        n = len(req.output_token_ids) + 1  # the token drawn now would be output token n
        if (self.eos is not None and not p.ignore_eos and self.stop_probability > 0 and may_stop(n, p.min_tokens)
                and random.Random(f"{self.seed}:{req.request_id}:{n}").random() < self.stop_probability):
            return self.eos
        token = FILLER_TOKEN
        while token in p.stop_token_ids or (token == self.eos and not p.ignore_eos):
            token += 1
        return token


def bookkeeping_cpu_tier(num_blocks: int, cpu_blocks: int, block_size: int) -> CPUTier:
    """The real CPU tier (which evicted blocks host memory holds, LRU) over a pool one value wide: its copies move
    a few bytes, and what a copy back costs is not in the step-cost model."""
    pool = [torch.zeros(1, num_blocks * block_size, 1)]
    return CPUTier(cpu_blocks, pool, pool, block_size)
