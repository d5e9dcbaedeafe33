"""Chapter 07: prefill/decode disaggregation (KV connectors, KV transfer, the router)."""
