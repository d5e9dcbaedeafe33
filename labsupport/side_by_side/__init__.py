"""Chapter 08: the course's mechanisms beside vLLM's — the same model, client, workload and dashboard."""
