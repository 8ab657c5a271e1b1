"""CPU execution helpers: C kernels built at first use (build.py) and GGUF block matmuls."""
