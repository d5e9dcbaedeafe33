"""One technique at a time, against the hardware's limits: the roofline (``roofline``, ``roofline_lab``),
quantization (``quant``), speculative decoding (``spec_bench``), and a process tree's memory (``tree_memory``,
chapter 07)."""
