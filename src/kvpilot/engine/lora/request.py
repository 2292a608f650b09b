"""Which LoRA adapter a request runs with: the adapter's identity, as plain data.

A :class:`LoRARequest` names a registered adapter (vLLM's ``vllm/lora/request.py`` has the
same three fields; the code is kvpilot's own). The scheduling core reads only its name and
integer id (how many distinct adapters a step holds, the prefix-cache namespace, the KV
events' ``lora_id``/``lora_name``); the weights themselves live in
:class:`kvpilot.engine.lora.manager.LoRAManager` and travel with the request as an opaque
reference (``Request.lora_weights``), so that the engine loop never reads a disk.

Standard library only: the scheduling core and the server import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A registered adapter.

    Attributes:
        lora_name: the name requests use as ``model`` (unique per engine).
        lora_int_id: a positive integer unique per registration in this engine (never 0,
            which vLLM reserves for "no adapter"); a name unloaded and loaded again gets
            a new id.
        lora_path: the local folder its ``adapter_config.json`` and weights came from.
        base_model_name: the base model it was declared for (``--lora-modules``'s JSON
            form), shown as ``parent`` in ``/v1/models``; None: the served model.
        fingerprint: a digest of the adapter's files ("" when unknown): with the name, the
            prefix-cache key (:attr:`cache_key`), so an adapter unloaded and loaded again
            under the same name with other weights never reads the old weights' KV, while
            every pod that loads the same files keys its blocks the same way.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    fingerprint: str = ""

    @property
    def cache_key(self) -> str:
        """The adapter's prefix-cache namespace: ``name`` or ``name@fingerprint``."""
        return f"{self.lora_name}@{self.fingerprint}" if self.fingerprint else self.lora_name

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
