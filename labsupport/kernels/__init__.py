"""The fast paths: compiled kernels, their Python side, and the executors that run a step faster, apart from the
model and the engine that call them.

``select.py`` is the one place that picks them: once, when the engine is built, for the device and dtype; the
model (``models/llama.py``) and the attention backend receive the choice and never ask for the device again.

* CPU: ``cpu_ops.py`` (RoPE, RMSNorm and SiLU-and-multiply, ``csrc/model_ops.cpp``), ``cpu_products.py`` and
  ``products.py`` (the products by rows, ``csrc/products.cpp``, and the weights' packed copies),
  ``cpu_attention.py`` (paged decode and prefill attention read in place, ``csrc/paged_decode.cpp``,
  ``csrc/paged_prefill.cpp``), ``cpu_decode_layers.py`` (a decode step one C++ call per layer,
  ``csrc/decode_layer.cpp``), ``cpu_memory.py`` (freed activation memory kept in the process).
* GPU: ``triton_ops.py`` (RoPE and SiLU-and-multiply), ``triton_attention.py`` (paged decode attention),
  ``cuda_graphs.py`` (decode steps replayed from CUDA graphs).

The C++ lives in ``csrc/`` as ordinary source files (one header, ``vectors.h``, for the vector type every
kernel is written with), built by one JIT helper (``jit.py``). Each kernel says when it applies and answers
None, or keeps PyTorch's path, where it does not. The kernels themselves import neither the model nor the
engine; ``select.py``, ``products.py`` and the two step executors join them to the model's and engine's types.
"""
