"""Adding many adapters' products to one batch: ``y[t] += B_s (A_s x[t])`` where ``s`` is
token ``t``'s adapter slot.

A step's tokens come in contiguous runs, one per scheduled request (its decode token or
its prefill chunk), so the step's mapping is a list of segments ``(length, slot)``
(:class:`LoRAMapping`; slot -1: the base model, nothing added). This is the SGMV
formulation of Punica (Chen et al. 2023) and S-LoRA (Sheng et al. 2023): per segment,
a shrink ``x @ A^T`` to the adapter's rank and an expand ``@ B^T`` back.

Three implementations of :func:`add_lora`:
- CUDA: the Triton SGMV kernels (:mod:`kvpilot.kernels.lora_sgmv`).
- CPU: two BLAS products per adapter present in the step. When an adapter's tokens are
  not one contiguous range (requests of several adapters interleaved), the adapter tokens
  are gathered once per projection into slot order, the products written there, and
  scattered back with one ``index_add_``; so a step costs one gather, two small products
  per adapter and one scatter per projection, whatever the number of requests.
- :func:`add_lora_reference`: a loop over segments, the definition the others are tested
  against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class LoRAMapping:
    """One step's tokens by adapter slot.

    Attributes:
        seg_lens, seg_slots: the step's contiguous segments in token order (adjacent
            segments of one slot merged): lengths and slots (-1: no adapter).
        num_tokens: their sum, the step's token count.
        ranges: per slot present, ``(slot, start, end)`` over the adapter tokens in slot
            order (the token order itself when ``perm`` is None).
        perm: None when every slot's tokens are already one contiguous range and the
            ranges index the step's tokens directly; else ``[n]`` int64, the step rows of
            the adapter tokens in slot order.
        seg_starts_t, seg_slots_t: the segments as int32 tensors on the device (the Triton
            kernels' inputs), built by :meth:`device_segments`.
    """

    seg_lens: list[int]
    seg_slots: list[int]
    num_tokens: int
    ranges: list[tuple[int, int, int]]
    perm: torch.Tensor | None
    seg_starts_t: torch.Tensor | None = None
    seg_slots_t: torch.Tensor | None = None

    @property
    def active_slots(self) -> set[int]:
        return {s for s in self.seg_slots if s >= 0}

    @classmethod
    def build(cls, lengths: Sequence[int], slots: Sequence[int], device: torch.device) -> LoRAMapping:
        """The mapping of a step whose requests have ``lengths[i]`` tokens each, in step
        order, on ``slots[i]`` (-1: none).

        Raises:
            ValueError: different list lengths or a negative length.
        """
        if len(lengths) != len(slots):
            raise ValueError(f"lengths ({len(lengths)}) and slots ({len(slots)}) differ in length")
        seg_lens: list[int] = []
        seg_slots: list[int] = []
        for n, s in zip(lengths, slots):
            if n < 0:
                raise ValueError(f"a segment length is negative: {n}")
            if n == 0:
                continue
            if seg_slots and seg_slots[-1] == s:
                seg_lens[-1] += n
            else:
                seg_lens.append(n)
                seg_slots.append(s)
        starts = [0]
        for n in seg_lens:
            starts.append(starts[-1] + n)
        by_slot: dict[int, list[int]] = {}
        for g, s in enumerate(seg_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(g)
        if all(len(gs) == 1 for gs in by_slot.values()):
            ranges = [(s, starts[gs[0]], starts[gs[0] + 1]) for s, gs in by_slot.items()]
            return cls(seg_lens, seg_slots, starts[-1], ranges, None)
        rows: list[int] = []
        ranges = []
        for s, gs in by_slot.items():
            first = len(rows)
            for g in gs:
                rows.extend(range(starts[g], starts[g + 1]))
            ranges.append((s, first, len(rows)))
        return cls(seg_lens, seg_slots, starts[-1], ranges, torch.tensor(rows, dtype=torch.int64, device=device))

    def device_segments(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The segments as int32 tensors on ``device`` (the Triton kernels' ``seg_starts``
        ``[G + 1]`` and ``seg_slots`` ``[G]``), built once per step and kept."""
        if self.seg_starts_t is None or self.seg_slots_t is None or self.seg_starts_t.device != device:
            starts = [0]
            for n in self.seg_lens:
                starts.append(starts[-1] + n)
            self.seg_starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
            self.seg_slots_t = torch.tensor(self.seg_slots, dtype=torch.int32, device=device)
        return self.seg_starts_t, self.seg_slots_t


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       mapping: LoRAMapping) -> None:
    """The definition: for each segment on slot ``s >= 0``,
    ``y[seg] += (x[seg] @ lora_a[s].T) @ lora_b[s].T`` in fp32.

    Args:
        y: ``[T, out]``, mutated in place. x: ``[T, in]``.
        lora_a: ``[S, R, in]``; lora_b: ``[S, out, R]`` (scaling folded in); zero past an
            adapter's width.
        mapping: the step's segments (``mapping.num_tokens == T``).
    """
    start = 0
    for n, s in zip(mapping.seg_lens, mapping.seg_slots):
        if s >= 0:
            xs = x[start:start + n].float()
            y[start:start + n] += ((xs @ lora_a[s].float().T) @ lora_b[s].float().T).to(y.dtype)
        start += n


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 mapping: LoRAMapping, widths: Sequence[int]) -> None:
    """:func:`add_lora_reference`'s result with two products per adapter present (see the
    module docstring), in ``x``'s dtype. ``widths[s]``: the used width of slot ``s`` (its
    columns past it are zero and skipped; 0: the adapter leaves this projection alone).
    Mutates ``y``."""
    if mapping.perm is None:
        for s, a, b in mapping.ranges:
            w = widths[s]
            if w:
                y[a:b].addmm_(x[a:b] @ lora_a[s, :w].T, lora_b[s, :, :w].T)
        return
    xs = x.index_select(0, mapping.perm)
    delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    touched = False
    for s, a, b in mapping.ranges:
        w = widths[s]
        if w:
            delta[a:b].addmm_(xs[a:b] @ lora_a[s, :w].T, lora_b[s, :, :w].T)
            touched = True
    if touched:
        y.index_add_(0, mapping.perm, delta)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    mapping: LoRAMapping, widths_t: torch.Tensor | None) -> None:
    """:func:`add_lora_reference`'s result through the Triton SGMV kernels
    (:func:`kvpilot.kernels.lora_sgmv.sgmv_lora`; on CPU tensors only under Triton's
    interpreter). ``widths_t``: the slots' used widths, int32 on the device. Mutates ``y``."""
    from kvpilot.kernels.lora_sgmv import sgmv_lora

    starts, slots = mapping.device_segments(y.device)
    sgmv_lora(y, x, lora_a, lora_b, starts, slots, widths_t)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping, widths: Sequence[int], widths_t: torch.Tensor | None = None) -> None:
    """``y[t] += B_s (A_s x[t])`` for the step's adapter tokens, on the device's path:
    :func:`add_lora_triton` on CUDA (``widths_t``: ``widths`` as an int32 device tensor),
    else :func:`add_lora_cpu`. Mutates ``y``."""
    if y.device.type == "cuda":
        add_lora_triton(y, x, lora_a, lora_b, mapping, widths_t)
    else:
        add_lora_cpu(y, x, lora_a, lora_b, mapping, widths)
