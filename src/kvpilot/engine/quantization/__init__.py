"""Quantized weight checkpoints: the canonical in-memory layouts and their products
(:mod:`~kvpilot.engine.quantization.weights`), reading a checkpoint's quantization config
(:mod:`~kvpilot.engine.quantization.config`) and turning its tensors into those layouts
(:mod:`~kvpilot.engine.quantization.checkpoint`, :mod:`~kvpilot.engine.quantization.gguf`)."""
