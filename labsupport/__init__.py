"""LLM Serving Lab: a small, real inference engine and server, built chapter by chapter.

``from labsupport import LLM, SamplingParams`` gives the same shape as vLLM's offline API.

The names are imported when first asked for (PEP 562), not with the package: processes that need no
model (``python -m labsupport router``, the launcher of ``labsupport.procs``) then never import torch,
whose import is a large share of such a process's start-up time and memory.
"""
__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name in ("SamplingParams", "RequestOutput"):
        from .engine import request
        return getattr(request, name)
    raise AttributeError(f"module 'labsupport' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
