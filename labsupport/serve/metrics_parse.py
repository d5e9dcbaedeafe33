"""Reading a Prometheus exposition back as numbers (``parse_metrics``): the client's side of ``GET /metrics``,
for our server's ``labsupport:`` metrics or vLLM's ``vllm:`` ones.

Apart from ``metrics.py``, which produces the exposition: the notebooks, the dashboard and the parity
checks read a server's metrics without making any. Importable from ``labsupport.serve.metrics`` as before.
"""
from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families


_HIDDEN_LABELS = ("model_name", "engine")


def parse_metrics(text: str | bytes) -> dict[str, float]:
    """An exposition (ours or vLLM's) as numbers, keyed three ways, each summed over the series it covers:

    * ``name``: every label set, e.g. ``labsupport:generation_tokens_total``,
      ``labsupport:e2e_request_latency_seconds_count``;
    * ``name{labels}`` with every label, sorted, e.g.
      ``labsupport:request_success_total{engine="0",finished_reason="stop",model_name="m"}``;
    * ``name{labels}`` without ``model_name`` and ``engine``, where other labels remain, e.g.
      ``labsupport:request_success_total{finished_reason="stop"}``,
      ``labsupport:time_to_first_token_seconds_bucket{le="0.1"}``.

    ``*_created`` series (creation timestamps) are left out.
    """
    if isinstance(text, bytes):
        text = text.decode()
    values: dict[str, float] = {}

    def add(key, value):
        values[key] = values.get(key, 0.0) + value

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            add(s.name, s.value)
            if not s.labels:
                continue
            add(_key(s.name, s.labels), s.value)
            rest = {k: v for k, v in s.labels.items() if k not in _HIDDEN_LABELS}
            if rest and len(rest) < len(s.labels):
                add(_key(s.name, rest), s.value)
    return values


def _key(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _escape(value: str) -> str:
    return re.sub(r'(["\\])', r"\\\1", value).replace("\n", "\\n")
