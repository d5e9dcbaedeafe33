"""The fast paths: compiled kernels and their Python side, apart from the model and the engine that call them.

The C++ lives in ``csrc/`` as ordinary source files (one header, ``vectors.h``, for the vector type every
kernel is written with), built by one helper (``build.py``). Each Python module here says when its kernels
apply and answers None, or keeps PyTorch's path, where they do not:

* ``cpu_ops.py``: RoPE, RMSNorm and SiLU-and-multiply in one call each (``csrc/model_ops.cpp``);
* ``cpu_products.py``: products of 1-128 rows (``csrc/products.cpp``), in the same extension;
* ``cpu_attention.py``: paged decode and prefill attention read in place (``csrc/paged_decode.cpp``,
  ``csrc/paged_prefill.cpp``).

The decode layer in one call (``csrc/decode_layer.cpp``) is built from these by ``kernels/cpu_decode_layers.py``.
Nothing here imports the model or the engine.
"""
