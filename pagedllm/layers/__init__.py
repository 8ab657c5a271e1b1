"""Model building blocks in vLLM's shape: linear layers with a TP + quantization hook, vocab embedding,
RMSNorm, rotary embedding, activations, the logits processor.

Import from the submodules (`pagedllm.layers.linear`, ...); this package file stays empty so that
`pagedllm.quantization` can import `pagedllm.layers.utils` without an import cycle.
"""
