from kvpilot.engine.cpu_threads import cgroup_cpu_limit, cpu_threads


def test_cgroup_v2_quota(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert cpu_threads(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(tmp_path) == 3.0


def test_omp_num_threads_wins(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert cpu_threads(tmp_path) == 7
