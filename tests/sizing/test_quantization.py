"""Weight bytes of quantized checkpoints: the format table, a small shape counted by hand,
the quantized presets against their published sizes, and config.json detection."""

import json

import pytest

from kvpilot.sizing import capacity, presets
from kvpilot.sizing import quantization as quant

# A small Llama-like decoder: hidden 256, MLP 512, 2 layers, 4 heads and 2 KV heads of 64,
# vocab 1000, untied. Per layer: q 256x256, k and v 256x128, o 256x256, gate and up
# 256x512, down 512x256 = 589,824 linear weights; 1,179,648 in 2 layers. Embeddings and
# LM head 2 x 1000 x 256 = 512,000. Norms 2 x 2 x 256 + 256 = 1,280.
SMALL = presets.ModelShape("small", 256, 512, 2, 4, 2, 1000, head_dim=64)
LINEAR, EMBEDDING, NORMS = 1_179_648, 512_000, 1_280


def test_the_small_shape_splits_into_linear_embedding_and_the_rest():
    assert SMALL.num_params == LINEAR + EMBEDDING + NORMS == 1_692_928
    assert SMALL.linear_layers() == ((256, 256, 2), (256, 128, 4), (256, 256, 2),
                                     (256, 512, 4), (512, 256, 2))
    assert SMALL.embedding_layers() == ((256, 1000, 2),)
    w = SMALL.weight_bytes(2, None)  # unquantized: every parameter at 2 B, as before
    assert w.total == 2 * 1_692_928 and w.quantization is None


@pytest.mark.parametrize(
    ("name", "linear_bytes"),
    [
        # 1,179,648 weights of 4 bits = 589,824 B; every input dim is a multiple of 128, so
        # 1,179,648 / 128 = 9,216 groups of one 2 B scale (w4a16), of a 2 B scale and a
        # 4-bit zero (GPTQ, AWQ)
        ("w4a16-g128", 589_824 + 9_216 * 2),
        ("w4a16-g32", 589_824 + 36_864 * 2),
        ("gptq-int4", 589_824 + 9_216 * 2.5),
        ("awq", 589_824 + 9_216 * 2.5),
        ("gptq-int8", 1_179_648 + 9_216 * 3),
        ("w8a16-g64", 1_179_648 + 18_432 * 2),
        # 8 bits each, plus an fp32 scale: per tensor (7 tensors x 2 layers); per output
        # row (256 + 128 + 128 + 256 + 512 + 512 + 256 = 2,048 rows x 2 layers); per 128x128
        # block (q 4, k 2, v 2, o 4, gate 8, up 8, down 8 = 36 x 2 layers)
        ("w8a8-fp8", 1_179_648 + 14 * 4),
        ("fp8", 1_179_648 + 14 * 4),
        ("w8a8-fp8-channel", 1_179_648 + 4_096 * 4),
        ("w8a8-int8", 1_179_648 + 4_096 * 4),
        ("fp8-block128", 1_179_648 + 72 * 4),
    ],
)
def test_linear_bytes_of_the_small_shape_by_hand(name, linear_bytes):
    w = SMALL.weight_bytes(2, name)
    assert w.linear_params == LINEAR and w.linear_bytes == linear_bytes
    # embeddings, LM head and norms stay in the model dtype (2 B)
    assert w.embedding_bytes == EMBEDDING * 2 and w.other_bytes == NORMS * 2
    assert w.total == linear_bytes + EMBEDDING * 2 + NORMS * 2


def test_gguf_quantizes_the_embeddings_and_lm_head_too():
    w = SMALL.weight_bytes(2, "gguf-q8_0")
    # blocks of 32: 8 bits + a 2 B scale each. Linear: 1,179,648 + 36,864 x 2; embeddings:
    # 512,000 + 16,000 x 2; norms stay at 2 B.
    assert w.linear_bytes == 1_179_648 + 73_728
    assert w.embedding_bytes == 512_000 + 32_000
    assert w.total == 1_253_376 + 544_000 + 2_560
    k = SMALL.weight_bytes(2, "gguf-q4_k")  # super-blocks of 256: 4 bits + 16 B
    assert k.linear_bytes == 589_824 + 4_608 * 16
    assert k.embedding_bytes == 256_000 + 2_000 * 16  # 2 tables of 1,000 rows of 256


@pytest.mark.parametrize(
    ("name", "bits"),
    [
        ("w4a16-g128", 4 + 16 / 128),  # 4.125
        ("w4a16-g64", 4.25),
        ("w4a16-g32", 4.5),
        ("w8a16-g128", 8.125),
        ("gptq-int4", 4 + (16 + 4) / 128),  # 4.15625
        ("awq", 4.15625),
        ("gptq-int8", 8 + (16 + 8) / 128),  # 8.1875
        ("gguf-q8_0", 8.5),
        ("gguf-q4_0", 4.5),
        ("gguf-q4_1", 5.0),
        ("gguf-q4_k", 4.5),
        ("gguf-q5_k", 5.5),
        ("gguf-q6_k", 6.5625),
        ("w8a8-fp8-channel", 8 + 32 / 4096),  # an fp32 scale per row of 4,096
        ("fp8-block128", 8 + 32 / (128 * 128)),
    ],
)
def test_bits_per_weight_of_a_4096_square(name, bits):
    assert quant.weight_format(name).bits_per_weight(4096, 4096) == pytest.approx(bits, abs=1e-9)


def test_a_row_that_does_not_fill_its_last_group_still_pays_its_scale():
    w4 = quant.weight_format("w4a16-g128")
    # 10 rows of 200: 1,000 B of values, cdiv(200, 128) = 2 groups per row of 2 B
    assert w4.linear_bytes(200, 10) == 1_000 + 10 * 2 * 2
    block = quant.weight_format("fp8-block128")
    assert block.linear_bytes(200, 130) == 26_000 + 2 * 2 * 4


def test_unknown_names_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"quantization must be one of fp8, .*gguf-q6_k; got 'int3'"):
        quant.weight_format("int3")
    with pytest.raises(ValueError, match="got 'int3'"):
        SMALL.weight_bytes(2, "int3")
    assert quant.VLLM_QUANTIZATIONS == ("fp8", "compressed-tensors", "gptq", "awq", "gguf")


# Quantized presets. Llama-3.1-8B: 6,979,321,856 linear weights, 2 x 525,336,576 embedding
# and LM head, 266,240 norm weights; 70B: 68,451,041,280, 2 x 1,050,673,152 and 1,318,912.
@pytest.mark.parametrize(
    ("name", "fmt", "total"),
    [
        # FP8 + an fp32 scale per tensor (7 x 32), the rest in bf16:
        # 6,979,321,856 + 896 + 2,101,346,304 + 532,480
        ("llama-3.1-8b-instruct-fp8", "w8a8-fp8", 9_081_201_536),
        # 68,451,041,280 + 2,240 + 4,202,692,608 + 2,637,824
        ("llama-3.1-70b-instruct-fp8", "w8a8-fp8", 72_656_373_952),
        # 4 bits + (2 B + 4 bits) per 128: 34,225,520,640 + 534,773,760 x 2.5 + 4,202,692,608
        # + 2,637,824
        ("llama-3.1-70b-instruct-awq-int4", "awq", 39_767_785_472),
        # Qwen3-8B: 6,945,767,424 linear weights in FP8 and 423,936 fp32 block scales
        # (per layer, ceil(out / 128) x ceil(in / 128): q 1,024, k and v 256 each, o 1,024,
        # gate and up 3,072 each, down 3,072), 2 x 622,329,856 embedding and LM head and
        # 36 x (2 x 4,096 + 2 x 128) + 4,096 = 308,224 norm weights in bf16:
        # 6,945,767,424 + 1,695,744 + 2,489,319,424 + 616,448
        ("qwen3-8b-fp8", "fp8-block128", 9_437_399_040),
    ],
)
def test_quantized_presets_weight_bytes(name, fmt, total):
    m = presets.model_preset(name)
    assert m.quantization == fmt
    assert m.weight_bytes(2).total == total
    assert m.weight_bytes(2, None).total == 2 * m.num_params  # the same shape in bf16


def test_qwen3_fp8_presets_have_the_published_shapes():
    """Qwen3-8B has 8.19B parameters (its model card), q/k norms included."""
    m = presets.model_preset("qwen3-8b-fp8")
    assert m.num_params == 8_190_735_360 and m.qk_norm
    big = presets.model_preset("qwen3-32b-fp8")
    assert big.quantization == "fp8-block128" and round(big.num_params / 1e9, 1) == 32.8


def test_the_fp8_preset_matches_its_published_checkpoint_size():
    """RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8 ships two shards of 5 GB and 4.08 GB."""
    m = presets.model_preset("llama-3.1-8b-instruct-fp8")
    assert round(m.weight_bytes(2).total / 1e9, 2) == 9.08
    assert m.num_params == presets.model_preset("llama-3.1-8b").num_params  # same shape


def test_every_preset_format_is_in_the_table_and_every_shape_decomposes():
    for m in presets.MODEL_PRESETS.values():
        assert not m.quantization or m.quantization in quant.WEIGHT_FORMATS, m.name
        linear = sum(i * o * c for i, o, c in m.linear_layers())
        embedding = sum(i * o * c for i, o, c in m.embedding_layers())
        rest = m.num_params - linear - embedding  # norms, biases, routers: small, >= 0
        assert 0 < rest < 0.001 * m.num_params, m.name
        assert m.weight_bytes(2, "w8a8-fp8").other_params == rest


def test_a_quantized_model_leaves_more_room_for_kv():
    """Llama-3.1-8B on an H100-80GB (85,520,809,984 B x 0.9 = 76,968,728,985.6 B), KV in
    bf16 at 131,072 B per token, blocks of 16 (2,097,152 B)."""
    m = presets.model_preset("llama-3.1-8b")
    per_token = capacity.kv_bytes_per_token(32, 8, 128, "bfloat16")

    def tokens(quantization):
        mem = capacity.kv_memory_bytes(81_559 * 2**20, 0.9, m.weight_bytes(2, quantization).total)
        return capacity.kv_capacity_tokens(mem, per_token, 16)

    assert tokens(None) == 464_688  # 16,060,522,496 B of weights
    # 9,081,201,536 B: 67,887,527,449.6 B // 2,097,152 = 32,371 blocks
    assert tokens("w8a8-fp8") == 517_936
    # 5,700,591,616 B: 71,268,137,369.6 B // 2,097,152 = 33,983 blocks
    assert tokens("w4a16-g128") == 543_728


@pytest.mark.parametrize(
    ("qc", "name"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": [128, 128]}, "fp8-block128"),
        ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
         "fp8"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, None),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}},
          "ignore": ["lm_head"]}, "w8a8-fp8"),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
         "w8a8-fp8-channel"),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "w8a8-int8"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                    "group_size": 64, "symmetric": True}}}}, "w4a16-g64"),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                        "symmetric": False}}}}, None),  # asymmetric: zero points not counted
        ({"quant_method": "compressed-tensors", "config_groups": {
            "a": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
            "b": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, None),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "gptq-int4"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq-int8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, None),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "awq"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, None),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "input_activations": {"num_bits": 8, "type": "float"}}}}, None),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": "not an object"}}, None),
    ],
)
def test_formats_from_hf_quantization_configs(qc, name):
    assert quant.format_from_hf_config(qc) == name


LLAMA_CFG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "vocab_size": 1000}


def test_a_quantized_folder_names_its_format_and_is_not_counted_from_headers(tmp_path):
    from tests.sizing.test_capacity import write_safetensors

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CFG, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}))
    # packed int32 weights: far fewer "parameters" than weights
    write_safetensors(tmp_path / "model.safetensors", {"qweight": [256, 32]})
    shape = presets.load_model_folder(tmp_path)
    assert shape.quantization == "awq" and shape.num_params == SMALL.num_params
    assert shape.weight_bytes(2).total == SMALL.weight_bytes(2, "awq").total
    # an older compressed-tensors config calls it compression_config
    old = {**LLAMA_CFG, "compression_config": {"quant_method": "compressed-tensors",
                                               "config_groups": {"g": {"weights": {
                                                   "num_bits": 8, "type": "float",
                                                   "strategy": "tensor"}}}}}
    assert presets.shape_from_config("m", old).quantization == "w8a8-fp8"
    odd = {**LLAMA_CFG, "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                "group_size": 32}}
    assert presets.shape_from_config("m", odd).quantization == (
        "unknown: quant_method gptq, bits 4, group_size 32")
