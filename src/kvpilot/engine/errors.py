"""The engine's request errors: what a request can fail with, in the engine or the server.

Engine modules (sampling parameters, structured outputs, the scheduler) raise them and
the server (:mod:`kvpilot.engine.server.error_handlers`) answers each with its HTTP
status in the OpenAI error body, so they live here, below both.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request parameter is out of range. ``param`` names the offending field.

    The server maps this to HTTP 400 with the OpenAI error body.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed to start or stopped; the request cannot be served."""


class RequestFailedError(RuntimeError):
    """The engine hit an internal error while running this request."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (its client went away or a sibling choice failed)."""


class LoRAAdapterExistsError(InvalidRequestError):
    """A LoRA adapter of that name is registered already (HTTP 400). ``param`` names the
    field that gave the name (``lora_name``); ``lora_name`` is the name, when known.
    :meth:`named` builds it with vLLM's message."""

    def __init__(self, message: str, param: str | None = "lora_name", *, lora_name: str | None = None) -> None:
        super().__init__(message, param)
        self.lora_name = lora_name

    @classmethod
    def named(cls, lora_name: str) -> LoRAAdapterExistsError:
        """The error for ``lora_name``, in vLLM's words."""
        return cls(f"The lora adapter '{lora_name}' has already been loaded.", "lora_name", lora_name=lora_name)


class LoRAAdapterNotFoundError(ModelNotFound):
    """No LoRA adapter of that name is registered (HTTP 404). ``param`` names the field
    that gave the name (``lora_name``); ``lora_name`` is the name, when known.
    :meth:`named` builds it with vLLM's message."""

    def __init__(self, message: str, param: str | None = "lora_name", *, lora_name: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.lora_name = lora_name

    @classmethod
    def named(cls, lora_name: str) -> LoRAAdapterNotFoundError:
        """The error for ``lora_name``, in vLLM's words."""
        return cls(f"The lora adapter '{lora_name}' cannot be found.", "lora_name", lora_name=lora_name)
