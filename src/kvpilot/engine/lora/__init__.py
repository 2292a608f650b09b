"""Multi-LoRA serving: PEFT adapters on one base model, many adapters in one batch.

:mod:`~kvpilot.engine.lora.request` names an adapter (plain data, for the scheduling core
and the server); the other modules load adapters, hold their weights in a fixed pool of
slots and add their products to the base model's projections.
"""
