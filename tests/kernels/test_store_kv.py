"""Triton KV store against the torch reference: bit-exact writes for every cache dtype,
skipped slots, strided inputs, FP8 clamping and round-to-nearest-even."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.store_kv import store_kv

from .cases import FP8, STORE_CASES, run_fp8_rounding_check, run_store_case


@pytest.mark.parametrize("case", STORE_CASES, ids=[c[0] for c in STORE_CASES])
def test_store_matches_reference_bit_for_bit(case):
    run_store_case(case)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_quantization_equals_torch_on_every_value_and_tie(dtype):
    run_fp8_rounding_check(dtype)


def test_all_slots_skipped_writes_nothing():
    kc = torch.zeros(2, 4, 1, 16)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 1, 16)
    store_kv(k, k, kc, vc, torch.tensor([-1, -1, -1]))
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, "slot_mapping must be int64"),
        ({"key": torch.ones(2, 2, 16)}, "must be \\[num_tokens, 1, 16\\]"),
        ({"cache_dtype": torch.float8_e4m3fn}, "k_scale is required"),
        ({"cache_dtype": torch.int8}, "not supported"),
    ],
)
def test_launcher_rejects_bad_arguments_with_a_clear_message(kwargs, message):
    cache_dtype = kwargs.pop("cache_dtype", torch.float32)
    kc = torch.zeros(2, 4, 1, 16, dtype=cache_dtype)
    args = {"key": torch.ones(2, 1, 16), "slot_mapping": torch.tensor([0, 1])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        store_kv(args["key"], args["key"], kc, kc.clone(), args["slot_mapping"])
