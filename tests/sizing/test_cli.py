"""kvpilot kv-calc through the real console entry point."""

import json

from kvpilot.cli import main


def test_kv_calc_prints_the_reference_numbers(capsys):
    assert (
        main(
            [
                "kv-calc",
                "--model",
                "llama-3-70b",
                "--kv-cache-dtype",
                "float16",
                "--context",
                "8192",
                "--context",
                "65536",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "2.68 GB" in out and "21.47 GB" in out and "327,680 B" in out


def test_kv_calc_json_with_a_gpu_and_costs(capsys):
    assert (
        main(
            [
                "kv-calc",
                "--model",
                "llama-3-8b",
                "--gpu",
                "H100-80GB",
                "--context",
                "8192",
                "--cost-per-replica-hour",
                "4",
                "--replicas",
                "2",
                "--generated-tokens-per-second",
                "1000",
                "--json",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["kv_capacity_tokens"] == 464_688
    assert r["per_request"][0]["max_concurrent_requests"] == 56
    assert r["cost_per_hour"] == 8.0 and r["cost_per_million_tokens"] > 0


def test_kv_calc_fp8_halves_and_4bit_states_its_scale(capsys):
    main(["kv-calc", "--model", "llama-3-70b", "--kv-cache-dtype", "fp8", "--json"])
    fp8 = json.loads(capsys.readouterr().out)
    main(["kv-calc", "--model", "llama-3-70b", "--kv-cache-dtype", "float16", "--json"])
    fp16 = json.loads(capsys.readouterr().out)
    assert fp8["kv_bytes_per_token"] * 2 == fp16["kv_bytes_per_token"]
    main(["kv-calc", "--model", "llama-3-70b", "--kv-cache-dtype", "fp4_e2m1"])
    assert "one fp8_e4m3 scale per 16 values" in capsys.readouterr().out


def test_kv_calc_bad_input_is_a_clear_error(capsys):
    assert main(["kv-calc", "--model", "not-a-model"]) == 2
    assert "model preset must be one of" in capsys.readouterr().err
    assert main(["kv-calc", "--context", "-5"]) == 2
    assert "--context must be > 0; got -5" in capsys.readouterr().err
    assert main(["kv-calc", "--list"]) == 0
    assert "H100-80GB" in capsys.readouterr().out


def test_kv_calc_warns_when_weights_leave_no_room(capsys):
    main(["kv-calc", "--model", "llama-3-70b", "--gpu", "H100-80GB"])
    assert "leave no room for a KV cache" in capsys.readouterr().out


def test_kv_calc_tensor_parallel_replicates_kv_heads_beyond_one_per_gpu(capsys):
    """Found in review: TP 16 over Llama-3-70B's 8 KV heads was counted as 16-way split,
    doubling the capacity; vLLM replicates each KV head on tp / kv_heads GPUs."""
    def tokens(tp):
        main(["kv-calc", "--model", "llama-3-70b", "--gpu", "H100-80GB",
              "--tensor-parallel-size", str(tp), "--json"])
        return json.loads(capsys.readouterr().out)
    t8, t16 = tokens(8), tokens(16)
    assert t16["kv_head_replication"] == 2 and t8["kv_head_replication"] == 1
    # Twice the memory, each token stored twice: about what 8 GPUs hold (weights shared).
    assert t16["kv_capacity_tokens"] < 1.2 * t8["kv_capacity_tokens"]
    assert main(["kv-calc", "--model", "llama-3-70b", "--gpu", "H100-80GB",
                 "--tensor-parallel-size", "3"]) == 2
    assert "it does not divide its intermediate_size 28672" in capsys.readouterr().err
    assert main(["kv-calc", "--model", "llama-3-70b", "--gpu", "H100-80GB",
                 "--tensor-parallel-size", "12"]) == 2
    assert "must be a multiple of them and divide the 64 attention heads" in capsys.readouterr().err


def test_kv_calc_sizes_an_uneven_split_by_its_fullest_gpu(tmp_path, capsys):
    """The engine splits 3 KV heads over 2 GPUs as 1 and 2 (SmolLM2 at TP=2): every GPU
    holds every block, so the GPU with 2 heads decides: 4/3 of the bytes an even split
    of the same memory would need per token."""
    shape = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
             "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "vocab_size": 49152, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(shape))

    def run(tp):
        assert main(["kv-calc", "--model", str(tmp_path), "--gpu-memory-gib", "8", "--block-size", "1",
                     "--tensor-parallel-size", str(tp), "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    one, two = run(1), run(2)
    assert two["kv_heads_per_gpu"] == 2 and two["kv_head_replication"] == 1
    stored_even = two["kv_memory_bytes"] // two["kv_bytes_per_token"]
    assert two["kv_capacity_tokens"] == int(two["kv_memory_bytes"] // (two["kv_bytes_per_token"] * 4 / 3))
    assert two["kv_capacity_tokens"] < stored_even and two["kv_capacity_tokens"] > one["kv_capacity_tokens"]


def test_kv_calc_states_the_window_cap_of_an_all_sliding_model(capsys):
    argv = ["kv-calc", "--model", "mistral-7b-v0.1", "--gpu", "H100-80GB", "--context", "32768"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sliding window   4,096: a sequence holds at most 4,112 tokens of KV" in out
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # (cdiv(4096, 16) + 1) x 16 = 4,112 tokens; 476,720 // 4,112 = 115 requests
    assert r["kv_tokens_per_request_max"] == 4112
    row = r["per_request"][0]
    assert row["kv_tokens"] == 4112 and row["kv_bytes"] == 4112 * 131_072
    assert r["kv_capacity_tokens"] == 476_720 and row["max_concurrent_requests"] == 115


def test_kv_calc_says_a_hybrid_saves_nothing_yet(capsys):
    argv = ["kv-calc", "--model", "gemma-2-9b", "--gpu", "H100-80GB", "--context", "32768"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4,096 on 21 of 42 layers: the sliding layers do not save memory yet" in out
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # 2 x 2 B x 42 x 8 x 256 = 344,064 B per token, all 32,768 tokens held
    assert r["kv_tokens_per_request_max"] is None
    assert r["per_request"][0]["kv_bytes"] == 32768 * 344_064
    assert r["per_request"][0]["max_concurrent_requests"] == 5


def test_kv_calc_quantization_sizes_the_weights_and_grows_the_pool(capsys):
    """Llama-3.1-8B on one H100-80GB: bf16 16.06 GB of weights and 464,688 tokens; FP8
    (compressed-tensors, per tensor) 9.08 GB and 517,936; W4A16 at group 128 5.70 GB and
    543,728 (tests/sizing/test_quantization.py counts them)."""
    def run(*extra):
        assert main(["kv-calc", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                     "--context", "8192", *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    bf16, fp8, w4 = run(), run("--quantization", "w8a8-fp8"), run("--quantization", "w4a16-g128")
    assert (bf16["quantization"], bf16["weight_bytes"], bf16["kv_capacity_tokens"]) == (
        None, 16_060_522_496, 464_688)
    assert bf16["linear_params"] is None and bf16["vllm_quantization"] is None
    # 6,979,321,856 x 4 bits + 54,525,952 groups x 2 B
    assert (w4["linear_params"], w4["linear_weight_bytes"]) == (6_979_321_856, 3_598_712_832)
    assert (fp8["quantization"], fp8["vllm_quantization"]) == ("w8a8-fp8", "compressed-tensors")
    assert (fp8["weight_bytes"], fp8["kv_capacity_tokens"]) == (9_081_201_536, 517_936)
    assert (w4["weight_bytes"], w4["kv_capacity_tokens"]) == (5_700_591_616, 543_728)
    assert w4["linear_bits_per_weight"] == 4.125 and not w4["embeddings_quantized"]
    assert w4["per_request"][0]["max_concurrent_requests"] == 66  # 543,728 // 8,192
    assert main(["kv-calc", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                 "--quantization", "w4a16-g128"]) == 0
    out = capsys.readouterr().out
    assert ("weights          5.70 GB  (w4a16-g128: linear layers 4.125 bits per weight;"
            " embeddings, LM head and norms bfloat16)") in out
    assert "KV capacity      543,728 tokens per replica" in out


def test_kv_calc_uses_a_presets_format_unless_told_otherwise(capsys):
    def run(*extra):
        assert main(["kv-calc", "--model", "llama-3.1-70b-instruct-awq-int4", "--gpu", "H100-80GB",
                     *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    awq, fp8 = run(), run("--quantization", "w8a8-fp8")
    assert (awq["quantization"], awq["weight_bytes"]) == ("awq", 39_767_785_472)
    assert fp8["weight_bytes"] == 72_656_373_952  # the 70B FP8 preset's bytes
    # 76,968,728,985.6 B usable on one H100-80GB; 327,680 B per token, blocks of 16:
    # AWQ leaves 37,200,943,513.6 B = 7,095 blocks, FP8 4,312,355,033.6 B = 822 blocks
    assert (awq["kv_capacity_tokens"], fp8["kv_capacity_tokens"]) == (113_520, 13_152)
    gguf = run("--quantization", "gguf-q4_k")
    assert gguf["embeddings_quantized"] and gguf["vllm_quantization"] == "gguf"


def test_kv_calc_refuses_an_unknown_quantization_naming_flag_value_and_choices(capsys):
    assert main(["kv-calc", "--model", "llama-3.1-8b", "--quantization", "int3"]) == 2
    err = capsys.readouterr().err
    assert "--quantization must be one of auto, fp8, fp8-block128, w8a8-fp8," in err
    assert "gguf-q6_k; got 'int3'" in err
    assert main(["kv-calc", "--list"]) == 0
    out = capsys.readouterr().out
    assert "  awq               awq                 AWQ 4-bit" in out
    assert "llama-3.1-70b-instruct-awq-int4" in out and "  w8a8-fp8\n" in out


def test_kv_calc_refuses_a_folder_whose_format_it_cannot_size(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1000, "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                      "group_size": 32}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["kv-calc", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "declares weights kv-calc cannot size (unknown: quant_method gptq, bits 4," in err
    assert "pass --quantization with one of fp8," in err
    assert main(["kv-calc", "--model", str(tmp_path), "--quantization", "w4a16-g32",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == "w4a16-g32"
