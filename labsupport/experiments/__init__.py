"""The chapters' measurements: most start real servers and drive them with ``bench``'s clients.

They sit above every other package (the engine, the servers, ``pd``'s cluster, ``bench``'s load
generators, ``viz``'s plots) so that none of those has to import a chapter's experiment:
``online_offline`` (chapter 05: interactive requests and batch jobs on one offline engine, first
come first served vs priorities), ``disaggregation`` (chapter 07: colocated vs chunked prefill vs
1P+1D), ``parity`` (chapter 08: chapters 02-05 again on ``vllm serve``), ``course_table`` (one row
per chapter on one workload) and ``capstone`` (chapter 09: every technique on, each one off, on
five traffics).
"""
