"""``count_failures``: the one rule behind ``kvpilot bench serve``'s exit status and the
scripts that read its result JSON."""

from __future__ import annotations

import pytest

from kvpilot.bench import BenchConfig, count_failures, run_benchmark


def summary(completed: int, failed: int = 0, cancelled: int = 0,
            not_sent: int | None = 0) -> dict:
    out = {"requests_completed": completed, "requests_failed": failed,
           "requests_cancelled": cancelled}
    if not_sent is not None:  # background streams plan nothing: no such key
        out["requests_not_sent"] = not_sent
    return out


def test_a_clean_run_has_no_failures():
    f = count_failures({"by_class": {"main": summary(40)}, "errors": []})
    assert (f.failed, f.not_sent, f.total, f.first_error) == (0, 0, 40, None)
    assert f.ratio == 0.0 and not f.exceeds(0.0)
    assert f.describe() == "0 of 40 requests failed (0.0%)"


def test_one_failed_request_exceeds_the_default():
    f = count_failures({"by_class": {"main": summary(39, failed=1)},
                        "errors": [{"error": "HTTP 400: too long", "count": 1}]})
    assert (f.failed, f.total) == (1, 40) and f.exceeds(0.0)
    assert not f.exceeds(0.025) and f.exceeds(0.02)
    assert f.describe() == "1 of 40 requests failed (2.5%); first error: HTTP 400: too long"


def test_unsent_turns_and_every_class_count():
    result = {"by_class": {"main": summary(35, failed=1, not_sent=4),
                           "background": summary(3, failed=2, cancelled=4, not_sent=None)},
              "errors": [{"error": "HTTP 500: a", "count": 2}, {"error": "b", "count": 1}]}
    f = count_failures(result)
    assert (f.failed, f.not_sent, f.unfinished, f.total) == (3, 4, 7, 40 + 9)
    assert f.first_error == "HTTP 500: a"
    assert f.describe().startswith("3 of 49 requests failed and 4 were not sent (14.3%)")


def test_a_result_without_the_counts_is_an_error_not_a_pass():
    """The fault this guards against: a check reading a key the result does not have."""
    with pytest.raises(KeyError):
        count_failures({"failed": 0, "summary": {}})
    with pytest.raises(KeyError, match="requests_failed"):
        count_failures({"by_class": {"main": {"requests_completed": 4}}})
    with pytest.raises(ValueError, match="no request class"):
        count_failures({"by_class": {}})


def test_counts_a_real_run_with_injected_failures(fake):
    server = fake(fail_every=4)
    result = run_benchmark(BenchConfig(base_url=server.url, num_prompts=8, random_input_len=8,
                                       output_len=2, timeout_s=20))
    f = count_failures(result.to_json())
    assert (f.failed, f.not_sent, f.total) == (2, 0, 8)
    assert f.first_error is not None and f.first_error.startswith("HTTP 500: injected failure")
