"""The e2e harness's pieces that run before or around the cluster: the pace every bound is
multiplied by, the record of waits, the image step's bounds, and the containerd import
(against a stand-in ``ctr`` that records its command lines)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from e2e import images, pace, prepare, procs


def test_the_pace_scales_bounds_only_on_a_slower_machine():
    ref = pace.REFERENCE_ENGINE_START_S
    assert pace.Pace().factor == 1.0  # not measured yet: the bounds as set
    assert pace.Pace(engine_start_s=ref / 2).factor == 1.0  # faster: never shorter
    slow = pace.Pace(engine_start_s=ref * 2.5)
    assert slow.factor == pytest.approx(2.5)
    assert slow.bound(240) == pytest.approx(600)
    assert pace.Pace(engine_start_s=ref * 9, forced=1.5).bound(100) == pytest.approx(150)


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "nan", "inf", "1e400", "101"])
def test_a_forced_pace_must_be_a_usable_number(monkeypatch, raw):
    monkeypatch.setenv(pace.PACE_ENV, raw)
    with pytest.raises(ValueError, match=f"{pace.PACE_ENV}=.*must be a number from 0.1 to 100"):
        pace.from_env()


def test_a_forced_pace_is_read(monkeypatch):
    monkeypatch.setenv(pace.PACE_ENV, "3")
    assert pace.from_env().factor == 3.0
    monkeypatch.delenv(pace.PACE_ENV)
    assert pace.from_env().forced is None


def test_every_wait_is_recorded_met_or_not(tmp_path):
    record = pace.Pace(engine_start_s=40.0)
    record.current_test = "test_x"
    calls = iter([None, None, "ok"])
    assert procs.wait_until(lambda: next(calls), 5, "the thing", interval=0.01,
                            on_done=record.record) == "ok"
    with pytest.raises(TimeoutError, match="waiting for never"):
        procs.wait_until(lambda: None, 0.05, "never", interval=0.01, on_done=record.record)
    (met, missed) = record.waits
    assert (met.what, met.met, met.test, met.bound) == ("the thing", True, "test_x", 5)
    assert (missed.what, missed.met) == ("never", False)
    assert missed.seconds >= 0.05
    assert record.closest(1) == [missed]  # it used all of its bound
    summary = record.summary()
    assert "bounds x2.00" in summary and "NOT MET  never" in summary
    record.write(tmp_path / "waits.json")
    assert '"factor": 2.0' in (tmp_path / "waits.json").read_text()


def test_an_image_step_past_its_bound_fails_naming_it(monkeypatch):
    monkeypatch.setitem(prepare.BOUNDS, "router", 0.01)
    timings: dict[str, float] = {}
    with pytest.raises(images.ImageBuildError, match="router took 0 s, over its bound of 0 s"):
        prepare._step("router", lambda: time.sleep(0.05), timings)
    assert timings["router"] >= 0.05
    monkeypatch.setenv("KVPILOT_E2E_IMAGE_BOUND_FACTOR", "100")
    assert prepare._step("router", lambda: "ref", timings) == "ref"


@pytest.mark.tools  # images.Builder checks for buildah, debootstrap and gcc
def test_a_failed_build_step_fails_with_its_log_tail(tmp_path):
    with images.Builder(tmp_path) as builder:
        with pytest.raises(images.ImageBuildError, match=r"(?s)slow failed \(still running after 0 s.*started"):
            builder.run("slow", ["sh", "-c", "echo started; sleep 5"], timeout=0.5)
        with pytest.raises(images.ImageBuildError, match=r"(?s)bad failed \(exit 3\).*boom"):
            builder.run("bad", ["sh", "-c", "echo boom; exit 3"])


# A stand-in for `ctr`: `images ls -q` prints the names in $STATE, `images import` appends
# what the fake archive names (or nothing, to play a broken import); argv goes to $ARGV.
FAKE_CTR = """#!/bin/sh
echo "$@" >> "$ARGV"
case "$*" in
  *"images ls -q"*) cat "$STATE" 2>/dev/null || true ;;
  *"images import"*) [ -n "$NAMES" ] && echo "$NAMES" >> "$STATE"; echo "unpacking $NAMES...done" ;;
  *"images rm"*) ;;
esac
"""


class FakeBuilder(images.Builder):
    def export(self, ref: str, archive: Path) -> Path:
        archive.write_text(ref)
        return archive


def _fake_ctr(tmp_path: Path, monkeypatch, names: str) -> list[str]:
    ctr = tmp_path / "ctr"
    ctr.write_text(FAKE_CTR)
    ctr.chmod(ctr.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("ARGV", str(tmp_path / "argv"))
    monkeypatch.setenv("STATE", str(tmp_path / "state"))
    monkeypatch.setenv("NAMES", names)
    return [str(ctr), "--address", "sock", "--namespace", "k8s.io"]


@pytest.mark.tools  # images.Builder checks for buildah, debootstrap and gcc
def test_an_import_makes_one_image_record_by_its_repository(tmp_path, monkeypatch):
    ref = "docker.io/kvpilot/engine:e2e-0123456789abcdef"
    ctr = _fake_ctr(tmp_path, monkeypatch, ref)
    with FakeBuilder(tmp_path / "cache") as builder:
        assert images.import_into(builder, ref, ctr) is True
        assert images.import_into(builder, ref, ctr) is False  # present: not again
    imports = [line for line in (tmp_path / "argv").read_text().splitlines() if "import" in line]
    assert len(imports) == 1
    assert "--base-name docker.io/kvpilot/engine " in imports[0]
    assert "--index-name" not in imports[0]


@pytest.mark.tools  # images.Builder checks for buildah, debootstrap and gcc
def test_an_import_that_names_nothing_is_an_error(tmp_path, monkeypatch):
    ref = "docker.io/kvpilot/router:e2e-0123456789abcdef"
    ctr = _fake_ctr(tmp_path, monkeypatch, "")
    with FakeBuilder(tmp_path / "cache") as builder, \
            pytest.raises(images.ImageBuildError,
                          match=r"(?s)named no such image \(containerd lists nothing\).*unpacking"):
        images.import_into(builder, ref, ctr)
    assert (tmp_path / "argv").read_text().count("images import") == 1  # not retried


def test_test_timeouts_follow_the_pace_markers_and_the_command_line(tmp_path):
    """The e2e conftest's hooks in a pytest run of their own: a test after the pace is set
    gets its timeout multiplied, a test's own marker is multiplied too, 0 stays 0."""
    import subprocess
    import sys
    import textwrap

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "conftest.py").write_text(
        "from e2e.tests.conftest import pytest_configure, pytest_runtest_protocol  # noqa: F401\n")
    (tmp_path / "test_paced.py").write_text(textwrap.dedent("""
        import pytest
        from e2e import pace

        def effective(request):
            return request.node.get_closest_marker("timeout").args[0]

        def test_a_measures():
            pace.PACE.engine_start_s = pace.REFERENCE_ENGINE_START_S * 3

        def test_b_scaled(request):
            assert effective(request) == pytest.approx(3 * 500)

        @pytest.mark.timeout(100)
        def test_c_own_marker_scaled(request):
            assert effective(request) == pytest.approx(300)

        @pytest.mark.timeout(0)
        def test_d_disabled_stays_disabled(request):
            assert effective(request) == 0
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           "/dev/null", "--timeout=500", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "4 passed" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          "/dev/null", "--rootdir", str(tmp_path), str(tmp_path)], cwd=repo,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(repo), "KVPILOT_E2E_PACE": "fast"})
    assert bad.returncode == 4 and "KVPILOT_E2E_PACE='fast'" in bad.stderr, bad.stderr[-2000:]


def test_one_containerd_at_a_time_on_the_cached_root(tmp_path, monkeypatch):
    from e2e import realnode

    monkeypatch.setattr(realnode, "CONTAINERD_ROOT", tmp_path / "containerd")
    held = realnode.lock_containerd_root()
    try:
        with pytest.raises(RuntimeError, match="is in use by another e2e session"):
            realnode.lock_containerd_root()
    finally:
        os.close(held)
    os.close(realnode.lock_containerd_root())  # free again once released
