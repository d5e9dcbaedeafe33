"""``python -m labsupport bench structured``: what a grammar costs per decode step.

Structured output (``engine/structured_output.py``) adds work to every step of a constrained request:
the matcher fills the request's row of the token bitmask (which of the vocabulary's tokens the grammar
allows next), the mask is applied to the logits, and after the draw the matcher accepts the token.
This runs the same batch twice on the real model, free text and then under a JSON schema, and
prints the step time of both and the grammar's own time per step (fill + apply, and accept, timed
around the sampler's calls), per step and per constrained request.

Only steps in which every request of the batch still decodes are counted, so both runs compare the
same batch size; a request that closes its JSON early ends that window. The machine's load is
printed with the figures: on a shared CPU they move with the neighbours.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "story": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "story", "tags"]}
ASK = [{"role": "user", "content": "Write a long story about a cat as JSON: its name, the story, and tags."}]


class Timed:
    """Wraps a method; each call's wall time goes to ``seconds``."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


def run_batch(llm, batch: int, tokens: int, structured, timers=()) -> list[tuple[float, ...]]:
    """Per step in which all ``batch`` requests decode: (step time, then each timer's time in it), in s."""
    from ...engine.request import SamplingParams
    engine = llm.engine
    ids, _ = llm.tokenize(ASK)
    params = SamplingParams(max_tokens=tokens, temperature=0.7, seed=1, structured_outputs=structured)
    reqs = [engine.add_request(ids, params) for _ in range(batch)]
    rows = []
    while not all(r.is_finished for r in reqs):
        decoding = all(r.output_token_ids and not r.is_finished for r in reqs)
        for t in timers:
            t.seconds.clear()
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        if decoding:
            rows.append((took, *(sum(t.seconds) for t in timers)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport bench structured", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of each request")
    args = parser.parse_args(argv)
    from ...llm import LLM
    from ..lab.roofline import warn_if_busy
    busy = warn_if_busy()
    llm = LLM(args.model, device=args.device)
    spec = {"json": SCHEMA}
    run_batch(llm, 2, 4, spec)  # warm-up: the grammar compiler, the compiled schema, the kernels
    run_batch(llm, 2, 4, None)
    free = [row[0] for row in run_batch(llm, args.batch, args.tokens, None)]
    so = llm.engine.structured_outputs
    so.mask, so.accept = Timed(so.mask), Timed(so.accept)
    rows = run_batch(llm, args.batch, args.tokens, spec, (so.mask, so.accept))
    if not free or not rows:
        print("no step had the whole batch decoding: raise --tokens")
        return 1
    constrained, masked, accepted = (list(col) for col in zip(*rows))
    ms = 1e3
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"structured output, per decode step: {llm.model_name} on {args.device}, batch {args.batch}, "
          f"{os.cpu_count()} cores, load average {load:.1f}"
          + (f", ~{busy:.1f} other runnable threads (a shared machine: figures are inflated)" if busy else ""))
    print(f"  step, free text:           median {statistics.median(free) * ms:7.2f} ms  ({len(free)} steps)")
    print(f"  step, JSON schema:         median {statistics.median(constrained) * ms:7.2f} ms  "
          f"({len(constrained)} steps)")
    grammar = [a + b for a, b in zip(masked, accepted)]
    print(f"  grammar work in the step:  median {statistics.median(grammar) * ms:7.3f} ms "
          f"= {statistics.median(grammar) * ms / args.batch:.3f} ms per constrained request "
          f"(bitmask fill + apply {statistics.median(masked) * ms:.3f} ms, accept {statistics.median(accepted) * ms:.3f} ms)")
    print(f"  share of the step:         {statistics.median(grammar) / statistics.median(constrained):6.1%}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
