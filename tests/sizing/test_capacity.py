"""KV sizing and FinOps arithmetic, model presets and HF folders."""

import json
import struct

import pytest

from kvpilot.sizing import capacity, presets

GB = 1e9


def llama70b_bytes(tokens, dtype):
    m = presets.model_preset("llama-3-70b")
    per_token = capacity.kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, dtype)
    return capacity.kv_bytes(per_token, tokens)


def test_llama_3_70b_fp16_reference_numbers():
    assert round(llama70b_bytes(8192, "float16") / GB, 2) == 2.68
    assert round(llama70b_bytes(65536, "float16") / GB, 2) == 21.47
    assert llama70b_bytes(1, "float16") == 2 * 2 * 80 * 8 * 128


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_halves_it(fp8):
    assert llama70b_bytes(8192, fp8) == llama70b_bytes(8192, "bfloat16") / 2


def test_four_bit_counts_one_scale_per_16_values():
    half = llama70b_bytes(8192, "float16") / 4  # 0.5 B of value per element
    assert llama70b_bytes(8192, "fp4_e2m1") == pytest.approx(half * (0.5 + 1 / 16) / 0.5)
    assert llama70b_bytes(8192, "int4") == pytest.approx(half * (0.5 + 1 / 16) / 0.5)
    assert capacity.kv_dtype("fp4_e2m1").scale_format == "fp8_e4m3"
    assert capacity.kv_dtype("int4").scale_format == "fp8_e4m3"
    # the engine's claim: at least 3.5x the tokens of bf16 in the same memory
    assert llama70b_bytes(8192, "bfloat16") / llama70b_bytes(8192, "int4") >= 3.5
    assert capacity.kv_bytes_per_token(1, 1, 128, "float32") == 2 * 4 * 128


def test_bad_inputs_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"KV dtype must be one of .*; got 'fp6'"):
        capacity.kv_dtype("fp6")
    with pytest.raises(ValueError, match="num_layers must be > 0; got 0"):
        capacity.kv_bytes_per_token(0, 8, 128, "fp8")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32 for int4; got 80"):
        capacity.kv_bytes_per_token(2, 2, 80, "int4")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]; got 1\.5"):
        capacity.kv_memory_bytes(80 * GB, 1.5, 0)
    with pytest.raises(ValueError, match="context_tokens must be > 0; got 0"):
        capacity.max_concurrent_requests(1000, 0)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("llama-3.1-405b", 405_853_388_800),
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-2-7b", 6_738_415_616),
        ("mistral-7b", 7_248_023_552),
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-7b", 7_615_616_512),
        ("smollm2-135m", 134_515_008),
        ("smollm2-1.7b", 1_711_376_384),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("qwen1.5-moe-a2.7b", 14_315_784_192),
    ],
)
def test_preset_parameter_counts_equal_the_model_cards(name, published):
    assert presets.model_preset(name).num_params == published


def test_capacity_and_concurrency_for_a_gpu():
    m = presets.model_preset("llama-3-8b")
    per_token = capacity.kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, "bfloat16")
    mem = capacity.kv_memory_bytes(presets.gpu_memory_bytes("H100-80GB"), 0.9, m.num_params * 2)
    tokens = capacity.kv_capacity_tokens(mem, per_token, block_size=16)
    assert tokens == 464_688 and tokens % 16 == 0
    assert capacity.max_concurrent_requests(tokens, 8192) == 56
    assert capacity.max_concurrent_requests(tokens, 8190, block_size=16) == 56
    assert capacity.max_concurrent_requests(100, 33, block_size=16) == 2  # 48 tokens each
    assert capacity.kv_memory_bytes(10 * GB, 0.9, 20 * GB) == 0.0  # weights do not fit


def test_finops_view():
    f = capacity.finops(
        kv_capacity_tokens=464_688,
        replicas=3,
        mean_context_tokens=4096,
        cost_per_replica_hour=4.0,
        generated_tokens_per_second=2000.0,
    )
    assert f.max_concurrent_requests == 113 and f.cost_per_hour == 12.0
    assert f.cost_per_million_tokens == pytest.approx(12.0 / (2000 * 3600) * 1e6)
    idle = capacity.finops(464_688, 3, cost_per_replica_hour=4.0, generated_tokens_per_second=0)
    assert idle.cost_per_million_tokens is None and idle.max_concurrent_requests is None


def write_safetensors(path, shapes):
    header = {
        name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in shapes.items()
    }
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_hf_folder_config_and_safetensors_headers(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            }
        )
    )
    shape = presets.load_model_folder(tmp_path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (24, 2, 64)
    assert shape.num_params == presets.model_preset("qwen2.5-0.5b").num_params
    write_safetensors(tmp_path / "model.safetensors", {"a": [10, 20], "b": [5]})
    assert presets.load_model_folder(tmp_path).num_params == 205


def test_hf_folder_errors(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        presets.load_model_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks 'num_attention_heads'"):
        presets.load_model_folder(tmp_path)
    with pytest.raises(ValueError, match="GPU must be one of"):
        presets.gpu_memory_bytes("B9000")
