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


# Sliding windows. Every layer slides (Mistral-7B-v0.1): a sequence holds at most
# cdiv(W, block_size) + 1 blocks. Sliding and full layers interleaved (Gemma 2/3): the
# engine's blocks carry every layer, the full layers keep them all, so no cap.

H100_BYTES = 81_559 * 2**20  # 85,520,809,984 B


def bf16_per_token(m):
    return capacity.kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, "bfloat16")


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("mistral-7b-v0.1", 7_241_732_096),
        ("gemma-2-9b", 9_241_705_984),
        ("gemma-3-1b", 999_885_952),
        # the 12B text decoder: 11,765,788,416 with a 262,144-row embedding (Keras preset
        # gemma3_12b_text); HF's text_config has 262,208 rows, 64 x 3840 more
        ("gemma-3-12b", 11_765_788_416 + 64 * 3840),
    ],
)
def test_sliding_window_presets_match_the_published_counts(name, published):
    assert presets.model_preset(name).num_params == published


def test_mistral_7b_v0_1_every_layer_slides_so_a_sequence_is_capped():
    m = presets.model_preset("mistral-7b-v0.1")
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (32, 32, 8, 128)
    assert (m.sliding_window, m.num_sliding_layers, m.kv_window) == (4096, 32, 4096)
    # 2 (K, V) x 2 B x 32 layers x 8 KV heads x 128 = 131,072 B per token
    per_token = bf16_per_token(m)
    assert per_token == 131_072
    # (cdiv(4096, 16) + 1) x 16 = 257 blocks = 4,112 tokens; block size 1: 4,097
    assert capacity.sliding_window_tokens(4096, 16) == 4112
    assert capacity.sliding_window_tokens(4096, 1) == 4097
    assert capacity.kv_tokens_per_request(32768, 16, 4096) == 4112
    assert capacity.kv_tokens_per_request(2000, 16, 4096) == 2000  # 125 blocks, under the cap
    assert capacity.kv_tokens_per_request(4096, 16, 4096) == 4096  # 256 blocks
    # H100-80GB: 85,520,809,984 x 0.9 - 2 x 7,241,732,096 = 62,485,264,793.6 B for KV;
    # // (131,072 x 16) = 29,795 blocks = 476,720 tokens
    mem = capacity.kv_memory_bytes(H100_BYTES, 0.9, m.num_params * 2)
    tokens = capacity.kv_capacity_tokens(mem, per_token, block_size=16)
    assert tokens == 476_720
    # 32k context: 476,720 // 4,112 = 115 requests, where full attention fits 476,720 // 32,768 = 14
    assert capacity.max_concurrent_requests(tokens, 32768, 16, m.kv_window) == 115
    assert capacity.max_concurrent_requests(tokens, 32768, 16) == 14
    f = capacity.finops(tokens, 1, mean_context_tokens=32768, block_size=16, sliding_window=4096)
    assert f.max_concurrent_requests == 115


@pytest.mark.parametrize(
    ("name", "layers", "heads", "kv_heads", "window", "sliding", "per_token", "h100_tokens", "at_32k"),
    [
        # 2 x 2 B x 42 x 8 x 256 = 344,064 B; (85,520,809,984 x 0.9 - 2 x 9,241,705,984)
        # // (344,064 x 16) x 16 = 169,968 tokens; // 32,768 = 5 requests
        ("gemma-2-9b", 42, 16, 8, 4096, 21, 344_064, 169_968, 5),
        # 2 x 2 B x 48 x 8 x 256 = 393,216 B; (85,520,809,984 x 0.9 - 2 x 11,766,034,176)
        # // (393,216 x 16) x 16 = 135,888 tokens; // 32,768 = 4 requests
        ("gemma-3-12b", 48, 16, 8, 1024, 40, 393_216, 135_888, 4),
    ],
)
def test_hybrid_sliding_models_are_sized_as_full_attention(
    name, layers, heads, kv_heads, window, sliding, per_token, h100_tokens, at_32k
):
    m = presets.model_preset(name)
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (
        layers, heads, kv_heads, 256
    )
    assert (m.sliding_window, m.num_sliding_layers) == (window, sliding)
    assert m.kv_window is None  # the full-attention layers keep every block
    assert bf16_per_token(m) == per_token
    mem = capacity.kv_memory_bytes(H100_BYTES, 0.9, m.num_params * 2)
    tokens = capacity.kv_capacity_tokens(mem, per_token, block_size=16)
    assert tokens == h100_tokens
    assert capacity.max_concurrent_requests(tokens, 32768, 16, m.kv_window) == at_32k


@pytest.mark.parametrize(
    ("name", "shape", "per_token"),
    [
        # experts hold no KV: 2 x 2 B x layers x KV heads x head_dim, as for a dense model
        ("mixtral-8x7b", (32, 32, 8, 128, 8), 2 * 2 * 32 * 8 * 128),  # 131,072 B
        ("qwen3-30b-a3b", (48, 32, 4, 128, 128), 2 * 2 * 48 * 4 * 128),  # 98,304 B
        ("qwen1.5-moe-a2.7b", (24, 16, 16, 128, 60), 2 * 2 * 24 * 16 * 128),  # 196,608 B
    ],
)
def test_moe_kv_is_sized_as_a_dense_model(name, shape, per_token):
    m = presets.model_preset(name)
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim, m.num_experts) == shape
    assert m.kv_window is None
    assert bf16_per_token(m) == per_token


def test_hf_configs_with_sliding_windows():
    mistral = {
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "sliding_window": 4096,
    }
    shape = presets.shape_from_config("m", mistral)
    assert shape.kv_window == 4096
    assert shape.num_params == presets.model_preset("mistral-7b-v0.1").num_params
    assert presets.shape_from_config("m", {**mistral, "sliding_window": None}).kv_window is None
    # Gemma 2 omits tie_word_embeddings (true) and may omit layer_types: even layers slide
    gemma2 = {
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 256000, "sliding_window": 4096,
    }
    shape = presets.shape_from_config("g", gemma2)
    assert (shape.num_sliding_layers, shape.kv_window) == (21, None)
    assert shape.num_params == presets.model_preset("gemma-2-9b").num_params
    # Gemma 3: the multimodal wrapper nests the decoder; one layer in six is full
    gemma3 = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
    }}
    shape = presets.shape_from_config("g3", gemma3)
    assert (shape.head_dim, shape.num_sliding_layers, shape.kv_window) == (256, 40, None)
    assert shape.num_params == presets.model_preset("gemma-3-12b").num_params
    # Qwen2 slides only with use_sliding_window, on the layers from max_window_layers on
    qwen = {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "sliding_window": 32768, "max_window_layers": 21,
    }
    assert presets.shape_from_config("q", qwen).sliding_window == 0
    on = presets.shape_from_config("q", {**qwen, "use_sliding_window": True})
    assert (on.num_sliding_layers, on.kv_window) == (3, None)
    every = presets.shape_from_config("q", {**qwen, "use_sliding_window": True, "max_window_layers": 0})
    assert every.kv_window == 32768
