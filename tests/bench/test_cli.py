"""`kvpilot bench serve` as a command: help, flag validation, a full run writing JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpilot.cli import main


def test_help_lists_the_datasets_and_load_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvpilot bench serve")
    for flag in ("--dataset", "--request-rate", "--max-concurrency", "--num-prompts",
                 "--random-input-len", "--random-output-len", "--random-range-ratio",
                 "--num-groups", "--shared-prefix-len", "--num-sessions", "--num-turns",
                 "--turn-input-len", "--system-prompt-len", "--think-time",
                 "--background-streams", "--result-json", "--timeout", "--api-key", "--seed",
                 "--max-failed-ratio"):
        assert flag in out
    assert "{random,shared-prefix,multi-turn}" in out


def test_bench_without_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench"])
    assert exit_.value.code == 2
    assert "BENCH_COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-rate", "-3"], "request_rate (--request-rate) must be a number > 0, "
                               "or inf for all at once, got -3.0"),
    (["--max-concurrency", "0"], "max_concurrency (--max-concurrency) must be an integer "
                                 ">= 1, got 0"),
    (["--random-range-ratio", "2"], "random_range_ratio (--random-range-ratio) must be a "
                                    "number in [0, 1), got 2.0"),
    (["--base-url", "127.0.0.1:8000"], "must be an http:// or https:// URL, "
                                       "got '127.0.0.1:8000'"),
    (["--max-failed-ratio", "1.5"], "max_failed_ratio (--max-failed-ratio) must be a number "
                                    "in [0, 1], got 1.5"),
    (["--max-failed-ratio", "-0.1"], "max_failed_ratio (--max-failed-ratio) must be a number "
                                     "in [0, 1], got -0.1"),
    (["--max-failed-ratio", "nan"], "max_failed_ratio (--max-failed-ratio) must be a number "
                                    "in [0, 1], got nan"),
])
def test_bad_values_exit_2_with_a_message_naming_the_value(capsys, argv, message):
    assert main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpilot bench serve: error: ") and message in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--dataset", "sharegpt"], "invalid choice: 'sharegpt'"),
    (["--num-prompts", "ten"], "invalid int value: 'ten'"),
    (["--extra-body", "[1]"], "must be a JSON object, got '[1]'"),
    (["--extra-body", "{oops"], "not valid JSON"),
    (["--percentiles", "50,x"], "must be comma-separated numbers such as 50,99, got '50,x'"),
    (["--max-failed-ratio", "some"], "argument --max-failed-ratio: invalid float value: 'some'"),
])
def test_unparsable_values_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_1_with_the_reason(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--timeout", "5"]) == 1
    assert "cannot list models at http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_full_run_prints_the_table_and_writes_json(fake, tmp_path, capsys):
    server = fake(ttft_s=0.01, itl_s=0.002)
    out = tmp_path / "sub" / "result.json"
    code = main(["bench", "serve", "--base-url", server.url + "/v1", "--dataset",
                 "shared-prefix", "--num-prompts", "6", "--num-groups", "2",
                 "--shared-prefix-len", "30", "--question-len", "5", "--output-len", "4",
                 "--max-concurrency", "2", "--request-rate", "200", "--percentiles", "50,90,99",
                 "--label", "caching=on", "--result-json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    for row in ("request throughput (req/s)", "output throughput (tok/s)",
                "total throughput (tok/s)", "TTFT mean (ms)", "TTFT p90 (ms)", "TPOT p99 (ms)",
                "ITL p50 (ms)", "E2E p99 (ms)", "prefix cache hit rate", "caching=on"):
        assert row in text
    data = json.loads(out.read_text())
    assert data["config"]["dataset"] == "shared-prefix"
    assert data["config"]["base_url"] == server.url
    assert data["summary"]["requests_completed"] == 6
    assert data["summary"]["total_output_tokens"] == 24
    assert set(data["summary"]["itl_ms"]) == {"mean", "p50", "p90", "p99", "count"}
    assert data["prefix_cache"]["source"] == "kvpilot"
    assert 0 < data["prefix_cache"]["hit_rate"] <= 0.5
    assert len(data["requests"]) == 6
    assert {r["group"] for r in data["requests"]} == {0, 1}
    assert server.state.max_in_flight <= 2


def test_all_requests_failing_exits_1(fake, capsys):
    server = fake(fail_every=1)
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "3",
                 "--random-input-len", "8", "--output-len", "2"]) == 1
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines()
                if line.startswith("requests failed")).split()[-1] == "3"
    for n in (1, 2, 3):  # distinct messages (each names its request number)
        assert f"error x1: HTTP 500: injected failure {n}" in out


RANDOM_6 = ["--num-prompts", "6", "--random-input-len", "8", "--output-len", "2"]


def test_one_failed_request_exits_1_and_says_why(fake, tmp_path, capsys):
    """Five of six requests succeed: still a failed run, with the report and JSON kept."""
    server = fake(fail_every=6)
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", server.url, *RANDOM_6,
                 "--result-json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "requests failed" in captured.out  # the report is printed first
    assert captured.err == ("kvpilot bench serve: error: 1 of 6 requests failed (16.7%); first "
                            "error: HTTP 500: injected failure 6 (--max-failed-ratio 0 "
                            "allows 0%)\n")
    summary = json.loads(out.read_text())["summary"]
    assert (summary["requests_completed"], summary["requests_failed"]) == (5, 1)


@pytest.mark.parametrize(("ratio", "code"), [("0.5", 0), ("0.34", 0), ("0.3", 1), ("1", 0)])
def test_max_failed_ratio_allows_a_share(fake, capsys, ratio, code):
    server = fake(fail_every=3)  # requests 3 and 6 fail: 2 of 6
    assert main(["bench", "serve", "--base-url", server.url, *RANDOM_6,
                 "--max-failed-ratio", ratio]) == code
    err = capsys.readouterr().err
    assert ("2 of 6 requests failed (33.3%)" in err) == bool(code), err


def test_a_multi_turn_failure_counts_the_turns_it_left_unsent(fake, capsys):
    server = fake(fail_every=2)  # one session: turn 1 fails, so turn 2 is never sent
    argv = ["bench", "serve", "--base-url", server.url, "--dataset", "multi-turn",
            "--num-sessions", "1", "--num-turns", "3", "--system-prompt-len", "8",
            "--turn-input-len", "4", "--output-len", "2"]
    assert main(argv) == 1
    assert ("error: 1 of 3 requests failed and 1 was not sent (66.7%); first error: HTTP "
            "500: injected failure 2" in capsys.readouterr().err)
    fake(fail_every=2)  # the same again (the request count restarts)
    assert main([*argv, "--max-failed-ratio", "0.5"]) == 1  # 2 of 3 unfinished
    assert "1 of 3 requests failed and 1 was not sent" in capsys.readouterr().err
    fake(fail_every=2)
    assert main([*argv, "--max-failed-ratio", "0.7"]) == 0


def test_no_request_completed_exits_1_whatever_the_ratio(fake, capsys):
    server = fake(fail_every=1)
    assert main(["bench", "serve", "--base-url", server.url, *RANDOM_6,
                 "--max-failed-ratio", "1"]) == 1
    assert "error: no request completed: 6 of 6 requests failed" in capsys.readouterr().err


def test_bench_never_imports_the_engine_or_torch():
    code = ("import sys, kvpilot.bench, kvpilot.bench.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'numpy') or m.startswith('kvpilot.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
