"""The inference engine: paged KV cache, radix prefix cache, chunked-prefill scheduler,
Llama-family model, sampler and the offline ``LLM`` API.

Heavy modules (torch) are imported lazily so ``import kvpilot.engine`` stays cheap.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvpilot.engine.llm import LLM

        return LLM
    if name == "EngineArgs":
        from kvpilot.engine.config import EngineArgs

        return EngineArgs
    if name == "SamplingParams":
        from kvpilot.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
