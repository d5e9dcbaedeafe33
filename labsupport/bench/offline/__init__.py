"""``bench compare`` and the offline workloads: our engine, transformers and vLLM's offline ``LLM`` on the same
token ids, in-process (``engine_runner``, ``hf_baseline``) or in vLLM's own venv (``vllm_runner`` drives the
``vllm_worker`` script); chapters 04-05's synthetic workloads (``workload``, ``driver``) and ``profiling``."""
