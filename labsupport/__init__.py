"""LLM Serving Lab: a small, real inference engine and server, built chapter by chapter.

``from labsupport import LLM, SamplingParams`` gives the same shape as vLLM's offline API.
"""
from .engine.request import RequestOutput, SamplingParams
from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
