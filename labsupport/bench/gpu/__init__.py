"""The GPU checks: one prepared script (``gpu_check``) of parity, decode, chunked-prefill and compute-less
checks on random models, and the bundle (``gpu_bundle``, standard library only) that carries the course to a
GPU machine and runs its notebooks there (``gpu_course``)."""
