"""Servers measured over HTTP, as a client sees them: the load generator (``serve_bench``, ``bench serve``), its
datasets, the server's ``/metrics`` read around a run, plots, and the suites built on them: ``serve_compare``
and ``serve_profile`` (ours against ``vllm serve``), ``soak`` (the served path under abuse) and
``structured_bench`` (what a grammar costs a step)."""
