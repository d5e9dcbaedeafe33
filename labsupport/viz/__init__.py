"""Notebook visualisations of the engine's state (ipywidgets views used by the chapters)."""
