"""The e2e harness cleans up when the run is killed: SIGTERM (a CI timeout, `kill`) must
unwind the pytest session so the cluster fixture's ``finally`` removes mounts, network
namespaces and cgroups, instead of killing the children and leaving those behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_sigterm_runs_the_session_fixture_teardown(tmp_path):
    marker = tmp_path / "torn-down"
    (tmp_path / "test_killed.py").write_text(textwrap.dedent(f"""
        import os, signal, time
        import pytest
        from e2e import procs

        @pytest.fixture(scope="session")
        def node():
            procs.install_signal_handlers(interrupt=True)
            try:
                yield
            finally:
                open({str(marker)!r}, "w").write("clean")

        def test_killed_mid_run(node):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the signal interrupts this
            raise AssertionError("not interrupted")
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
                           str(tmp_path / "test_killed.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert marker.read_text() == "clean", proc.stdout + proc.stderr
    assert proc.returncode == 2 and "KeyboardInterrupt" in proc.stdout, proc.stdout  # pytest: interrupted
    assert "signal SIGTERM" in proc.stdout
