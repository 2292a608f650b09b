"""KV-cache sizing: bytes per token, pool capacity, FinOps arithmetic, model and GPU
presets, and ``kvpilot kv-calc``. Standard library only, so every component may import it:

==============  ================================================================
``capacity``    the KV formula (:func:`~kvpilot.sizing.capacity.kv_token_bytes`),
                KV dtypes, pool capacity, concurrency and cost
``quantization`` weight formats of quantized checkpoints (bits per weight, scales),
                a model's weight bytes in one, the format of a ``config.json``
``presets``     model shapes (HF ``config.json`` fields) and GPU memory sizes
``cli``         ``kvpilot kv-calc``
==============  ================================================================

Users: the engine's KV cache (``kvpilot.engine.kv_cache``), the operator's FinOps status
(``kvpilot.operator.autoscaling.plan``), the operator's ``spec.model.quantization``
(``kvpilot.operator.spec.model``) and ``kvpilot kv-calc``. Layering (import-linter):
this package imports nothing else from kvpilot and nothing outside the standard library.
"""
