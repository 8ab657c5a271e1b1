"""`pagedllm bench`: vLLM's benchmark commands (throughput, latency, serve) plus the prefix-cache bench,
each printing the speed-of-light floor (roofline.py) where it applies."""
