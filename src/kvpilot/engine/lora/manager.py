"""The engine's adapters: the registry, the host copies and the device slots.

Three tiers, as vLLM's LoRA managers (``vllm/lora/worker_manager.py``,
``LRUCacheLoRAModelManager``); the code is kvpilot's own:

- **Registry**: every adapter registered by name (``--lora-modules`` at start,
  ``/v1/load_lora_adapter`` at run time) with its folder and a fresh integer id.
  Unbounded; a name is unique.
- **Host copies**: the parsed weights (:class:`~kvpilot.engine.lora.adapter.LoRAWeights`,
  fp32 on the CPU) of at most ``max_cpu_loras`` adapters, least recently used dropped
  first; a dropped adapter is read from its folder again by :meth:`LoRAManager.acquire`.
  The server acquires off its event loop and hands the weights to the engine with the
  request (``Request.lora_weights``), so the engine loop never reads a disk, and a request
  keeps its adapter's weights alive even if the host cache drops them meanwhile.
- **Slots**: ``max_loras`` device slots in every adapted projection
  (:class:`~kvpilot.engine.lora.layers.LoRALinear`). Before each step
  :meth:`LoRAManager.prepare_step` puts the step's adapters into slots (free ones first,
  then the least recently used slot whose adapter is not in this step) and sets the
  step's :class:`~kvpilot.engine.lora.ops.LoRAMapping`. The scheduler never lets a step
  hold more than ``max_loras`` adapters.

Thread safety: :meth:`register`, :meth:`unregister`, :meth:`get`, :meth:`list` and
:meth:`acquire` may be called from any thread (one lock); :meth:`prepare_step` and
:meth:`finish_step` only from the engine loop.
"""

from __future__ import annotations

import builtins
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvpilot.engine.errors import (
    InvalidRequestError,
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
    RequestFailedError,
)
from kvpilot.engine.lora.adapter import LoRAWeights, fingerprint, load_adapter, module_slices
from kvpilot.engine.lora.layers import LoRALinear, LoRAStep
from kvpilot.engine.lora.ops import LoRAMapping
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.lora.sources import resolve
from kvpilot.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

# Adapter names: OpenAI model ids, printable, bounded (they reach logs and metric labels).
MAX_NAME_LENGTH = 256
# The slot stacks may take at most this share of the machine's memory (CPU) or of the
# device's free memory (CUDA), checked before they are allocated.
MAX_SLOT_MEMORY_SHARE = 0.5

# The projections of a decoder layer that take adapters: (parent attribute, child attribute).
ADAPTABLE = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA limits.

    Attributes:
        max_loras: adapters in one step (device slots), >= 1.
        max_lora_rank: the largest ``r`` accepted, >= 1.
        max_cpu_loras: host copies kept, >= ``max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1; got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1; got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")


class LoRAManager:
    """Adapter slots on one model, and the adapters that can fill them.

    Args:
        model: the loaded decoder (``model.layers[i].self_attn``/``.mlp``); its adaptable
            projections are wrapped in :class:`LoRALinear` (mutated; wrappers left by an
            earlier manager on the same model are replaced).
        model_config: its architecture (tensor-parallel size 1).
        config: the limits.
        device, dtype: of the slot stacks (the model's).
    Raises:
        ValueError: the model has no adaptable projection.
    """

    def __init__(self, model: nn.Module, model_config: ModelConfig, config: LoRAConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.step = LoRAStep()
        self.modules: dict[tuple[int, str], LoRALinear] = {}
        check_slot_memory(slot_bytes(model, model_config, config, dtype), config, device)
        for i, layer in enumerate(model.layers):  # type: ignore[arg-type]
            for parent_name, attr in ADAPTABLE:
                parent = getattr(layer, parent_name, None)
                child = getattr(parent, attr, None) if parent is not None else None
                if child is None:
                    continue  # a mixture-of-experts layer's MLP: not adaptable
                if isinstance(child, LoRALinear):
                    setattr(parent, attr, child.base)
                module = f"{parent_name}.{attr}"
                slices = len(module_slices(model_config, module)[2])
                wrapper = LoRALinear(getattr(parent, attr), config.max_loras, slices * config.max_lora_rank,
                                     self.step, device, dtype)
                setattr(parent, attr, wrapper)
                self.modules[(i, module)] = wrapper
        if not self.modules:
            raise ValueError("this model has no projection an adapter can attach to")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._registry: dict[str, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()
        self._local: dict[int, Path] = {}  # id -> the folder read (a URI's fetched copy)
        # Slot s holds the adapter with id _slots[s] (None: empty); _slot_use: LRU order.
        self._slots: list[int | None] = [None] * config.max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict()
        self.loads = 0  # adapters read from disk (registrations and host-cache misses)
        self.slot_loads = 0  # copies into a device slot

    @property
    def nbytes(self) -> int:
        """The bytes of every slot stack (allocated at construction)."""
        return sum(m.nbytes for m in self.modules.values())

    # ------------------------------------------------------------ registry
    def register(self, name: str, path: str | Path, base_model_name: str | None = None) -> LoRARequest:
        """Read, check and register the adapter at ``path`` as ``name`` (its host copy is
        kept). ``path``: a local folder or a URI fetched first
        (:func:`kvpilot.engine.lora.sources.resolve`). Call off the event loop: it reads
        the disk and may fetch.

        Raises:
            LoRAAdapterExistsError: ``name`` is registered already.
            InvalidRequestError: the folder, config or weights are refused (``param``
                names the file and field); nothing is registered.
        """
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"lora_name must be a non-empty string, got {name!r}", "lora_name")
        if len(name) > MAX_NAME_LENGTH or name != name.strip() or not name.isprintable():
            shown = name if len(name) <= 80 else name[:80] + "..."
            raise InvalidRequestError(f"lora_name {shown!r}: at most {MAX_NAME_LENGTH} printable characters, "
                                      "no leading or trailing spaces", "lora_name")
        with self._lock:
            if name in self._registry:
                raise LoRAAdapterExistsError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            int_id = next(self._ids)
        local = resolve(str(path), name, logger.info)  # fetched first when it is a URI
        weights = self._read(local, name, int_id)
        request = LoRARequest(name, int_id, str(path), base_model_name, fingerprint(local))
        with self._lock:
            if name in self._registry:  # registered by another thread meanwhile
                raise LoRAAdapterExistsError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            self._registry[name] = request
            self._local[int_id] = local
            self._keep(weights)
        return request

    def unregister(self, name: str) -> LoRARequest:
        """Forget ``name``: new requests for it are refused; requests already running keep
        their weights and finish. Its host copy is dropped (its slot is reused when needed).

        Raises:
            LoRAAdapterNotFoundError: no adapter of that name.
        """
        with self._lock:
            request = self._registry.pop(name, None)
            if request is None:
                raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
            self._host.pop(request.lora_int_id, None)
            self._local.pop(request.lora_int_id, None)
        return request

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._registry.get(name)

    def list(self) -> list[LoRARequest]:
        """The registered adapters, in registration order."""
        with self._lock:
            return sorted(self._registry.values(), key=lambda r: r.lora_int_id)

    def acquire(self, request: LoRARequest) -> LoRAWeights:
        """The host weights of ``request``'s adapter, read from its folder again when the
        host cache dropped them (may read the disk: call off the event loop).

        Raises:
            LoRAAdapterNotFoundError: the adapter was unregistered.
            RequestFailedError: its folder can no longer be read or is refused now (a
                server-side fault: the request named a registered adapter).
        """
        with self._lock:
            if self._registry.get(request.lora_name) != request:
                raise LoRAAdapterNotFoundError(f"The model `{request.lora_name}` does not exist.")
            weights = self._host.get(request.lora_int_id)
            if weights is not None:
                self._host.move_to_end(request.lora_int_id)
                return weights
            local = self._local[request.lora_int_id]
        try:
            weights = self._read(local, request.lora_name, request.lora_int_id)
        except InvalidRequestError as e:  # the folder changed or went away since it was loaded
            raise RequestFailedError(f"LoRA adapter {request.lora_name!r} can no longer be read from {local} "
                                     f"(it was loaded from there; unload and load it again): {e}") from None
        with self._lock:
            if self._registry.get(request.lora_name) == request:
                self._keep(weights)
        return weights

    def _read(self, path: Path, name: str, int_id: int) -> LoRAWeights:
        adaptable = set(self.modules)
        weights = load_adapter(path, name, int_id, self.model_config, self.config.max_lora_rank, adaptable)
        self.loads += 1
        return weights

    def _keep(self, weights: LoRAWeights) -> None:
        """Host-cache ``weights`` (most recent), dropping the least recently used beyond
        ``max_cpu_loras``. Call with the lock held."""
        self._host[weights.int_id] = weights
        self._host.move_to_end(weights.int_id)
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)

    @property
    def host_ids(self) -> builtins.list[int]:
        """Ids of the adapters with a host copy, least recently used first."""
        with self._lock:
            return list(self._host)

    # --------------------------------------------------------------- slots
    @property
    def slot_ids(self) -> builtins.list[int | None]:
        """The adapter id in each device slot (None: empty)."""
        return list(self._slots)

    def prepare_step(self, lengths: Sequence[int], adapters: Sequence[LoRAWeights | None]) -> None:
        """Put this step's adapters into slots and set the step's mapping.

        Args:
            lengths: the tokens of each scheduled request, in step order.
            adapters: each request's adapter weights (None: the base model).
        Raises:
            ValueError: more distinct adapters than ``max_loras`` (the scheduler's bound
                was broken), or different list lengths.
        Mutates the slots (copies) and ``self.step.mapping``.
        """
        wanted: dict[int, LoRAWeights] = {}
        for w in adapters:
            if w is not None:
                wanted.setdefault(w.int_id, w)
        if not wanted:
            self.step.mapping = None
            return
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step holds {len(wanted)} adapters; --max-loras is {self.config.max_loras}")
        slot_of = {aid: s for s, aid in enumerate(self._slots) if aid is not None}
        for aid, weights in wanted.items():
            if aid in slot_of:
                continue
            slot = self._free_slot(set(wanted))
            self._load_slot(slot, weights)
            slot_of[aid] = slot
        for aid in wanted:
            self._slot_use.pop(aid, None)
            self._slot_use[aid] = None
        slots = [-1 if w is None else slot_of[w.int_id] for w in adapters]
        self.step.mapping = LoRAMapping.build(lengths, slots, self.device)

    def finish_step(self) -> None:
        """Clear the step's mapping (the projections are the base ones again)."""
        self.step.mapping = None

    def _free_slot(self, keep: set[int]) -> int:
        if None in self._slots:
            return self._slots.index(None)
        for aid in self._slot_use:  # least recently used first
            if aid not in keep:
                return self._slots.index(aid)
        raise ValueError("no adapter slot can be freed")  # unreachable when len(keep) <= max_loras

    def _load_slot(self, slot: int, weights: LoRAWeights) -> None:
        old = self._slots[slot]
        if old is not None:
            self._slot_use.pop(old, None)
        for key, module in self.modules.items():
            ab = weights.modules.get(key)
            if ab is None:
                module.set_slot(slot, None, None)
            else:
                module.set_slot(slot, ab[0].to(self.device, module.lora_a.dtype, non_blocking=True),
                                ab[1].to(self.device, module.lora_b.dtype, non_blocking=True))
        self._slots[slot] = weights.int_id
        self.slot_loads += 1


def slot_bytes(model: nn.Module, model_config: ModelConfig, config: LoRAConfig, dtype: torch.dtype) -> int:
    """The bytes the slot stacks of ``model`` will take: per adaptable projection,
    ``max_loras x R x (in + out)`` elements of ``dtype``."""
    total = 0
    for layer in model.layers:  # type: ignore[union-attr]
        for parent_name, attr in ADAPTABLE:
            parent = getattr(layer, parent_name, None)
            if parent is None or getattr(parent, attr, None) is None:
                continue
            fin, fout, sizes = module_slices(model_config, f"{parent_name}.{attr}")
            total += config.max_loras * len(sizes) * config.max_lora_rank * (fin + fout)
    return total * torch.finfo(dtype).bits // 8


def check_slot_memory(nbytes: int, config: LoRAConfig, device: torch.device) -> None:
    """Refuse, before allocating, slot stacks above :data:`MAX_SLOT_MEMORY_SHARE` of the
    machine's memory (CPU) or of the device's free memory (CUDA).

    Raises:
        ValueError: naming the size, ``--max-loras`` and ``--max-lora-rank``.
    """
    if device.type == "cuda":
        limit = torch.cuda.mem_get_info(device)[0]
        where = "of the GPU's free memory"
    else:
        import os

        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = "of this machine's memory"
    if nbytes > MAX_SLOT_MEMORY_SHARE * limit:
        raise ValueError(f"the LoRA slots of --max-loras {config.max_loras} x --max-lora-rank {config.max_lora_rank} "
                         f"take {nbytes / 2**30:.1f} GiB, more than {MAX_SLOT_MEMORY_SHARE:.0%} {where} "
                         f"({limit / 2**30:.1f} GiB); lower --max-loras or --max-lora-rank")
