"""Text the chapters use as workload material, kept out of the notebooks so a cell shows the idea."""
from importlib.resources import files


def text(name: str) -> str:
    """A shipped text file, e.g. ``text("northwind_handbook.txt")``: chapter 03's ~1,000-token system prompt
    of a help-desk assistant (rules, policies, a slice of a knowledge base)."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")
