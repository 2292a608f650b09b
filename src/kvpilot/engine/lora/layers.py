"""A projection with adapter slots: the base linear plus ``B_s (A_s x)`` per token.

:class:`LoRALinear` wraps one of the decoder's projections (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``: an ``nn.Linear`` or its CPU-packed copy) and holds, for
each of the ``max_loras`` slots, that adapter's ``A`` and ``B`` for this projection
(vLLM's ``lora_a_stacked``/``lora_b_stacked``, one stack per projection). Which slot each
token uses is the step's :class:`~kvpilot.engine.lora.ops.LoRAMapping`, which the
:class:`~kvpilot.engine.lora.manager.LoRAManager` sets on the shared :class:`LoRAStep`
before the forward pass and clears after it; with none set (a step with no adapter
request) the projection is exactly the base one.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.lora.ops import LoRAMapping, add_lora


class LoRAStep:
    """The current step's mapping, shared by every :class:`LoRALinear` of one model.

    Attributes:
        mapping: None outside a step or in a step without adapter tokens.
    """

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    """``base(x) + B_s (A_s x)``.

    Args:
        base: the projection (``in_features``/``out_features`` attributes; called as
            ``base(x)``). Kept as a child: its parameter names are unchanged under ``base``.
        slots: ``max_loras``.
        width: the stacks' padded width ``R`` (``max_lora_rank`` times the projection's
            slices: 3 for q/k/v, 2 for gate/up).
        step: the model's shared :class:`LoRAStep`.
        device, dtype: of the stacks (the model's).
    Attributes:
        lora_a: ``[slots, R, in]``; lora_b: ``[slots, out, R]``, zeros past each slot's
            ``widths[s]`` columns (0: the slot's adapter leaves this projection alone).
    """

    def __init__(self, base: nn.Module, slots: int, width: int, step: LoRAStep,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.in_features = int(base.in_features)  # type: ignore[arg-type]
        self.out_features = int(base.out_features)  # type: ignore[arg-type]
        self.step = step
        self.lora_a = torch.zeros(slots, width, self.in_features, device=device, dtype=dtype)
        self.lora_b = torch.zeros(slots, self.out_features, width, device=device, dtype=dtype)
        self.widths: list[int] = [0] * slots
        self.widths_t = torch.zeros(slots, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.lora_a.numel() * self.lora_a.element_size() + self.lora_b.numel() * self.lora_b.element_size()

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Copy one adapter's ``A`` ``[w, in]`` and ``B`` ``[out, w]`` into ``slot`` (None:
        the adapter does not adapt this projection). Mutates the stacks.

        Raises:
            ValueError: ``w`` above the stacks' width or shapes that do not match.
        """
        if a is None or b is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            w = 0
        else:
            w = a.shape[0]
            if w > self.lora_a.shape[1] or a.shape[1] != self.in_features or tuple(b.shape) != (self.out_features, w):
                raise ValueError(f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a "
                                 f"[{self.out_features} x {self.in_features}] projection of width {self.lora_a.shape[1]}")
            self.lora_a[slot, :w].copy_(a)
            self.lora_a[slot, w:].zero_()
            self.lora_b[slot, :, :w].copy_(b)
            self.lora_b[slot, :, w:].zero_()
        self.widths[slot] = w
        self.widths_t[slot] = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]``: the base projection (a row-parallel one's reduce
        included) plus this step's adapters."""
        y: torch.Tensor = self.base(x)
        mapping = self.step.mapping
        if mapping is not None:
            add_lora(y, x, self.lora_a, self.lora_b, mapping, self.widths, self.widths_t)
        return y


def wrap(parent: nn.Module, attr: str, slots: int, width: int, step: LoRAStep,
         device: torch.device, dtype: torch.dtype) -> LoRALinear:
    """Replace ``parent.attr`` by a :class:`LoRALinear` around it; returns the wrapper.
    Mutates ``parent``."""
    wrapper = LoRALinear(getattr(parent, attr), slots, width, step, device, dtype)
    setattr(parent, attr, wrapper)
    return wrapper

