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
