"""Notebook visualisations of the engine's state (ipywidgets views used by the chapters).

``block_map.BlockMap`` (chapters 02-03: the KV block pool), ``kv_charts`` (chapter 01: KV bytes per
token), ``timeline.BatchTimeline`` (chapters 04-05: slots x steps), ``dashboard.ServerDashboard``
(chapter 06: a live server read from its ``/metrics``, ours or vLLM's).
"""
