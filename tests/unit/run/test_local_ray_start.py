"""The private Ray of `rlkube run`: a start that passes Ray's fixed 30 s raylet wait (a busy
machine) is tried again after the half-started Ray processes are stopped; other errors are not."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray

from rlkube_runtime.run import cluster

TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                      "failed to startup or the GCS has become overloaded.")


@pytest.fixture
def fake_ray_package(tmp_path, monkeypatch):
    """A directory standing for Ray's package, holding a script that stands for the GCS."""
    package = tmp_path / "ray"
    package.mkdir()
    (package / "gcs_server.py").write_text("import time\ntime.sleep(120)\n")
    monkeypatch.setattr(ray, "__file__", str(package / "__init__.py"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "LOCAL_RAY_RETRY_WAIT_S", 0.0)
    return package


def test_a_start_that_timed_out_is_tried_again_with_its_ray_processes_stopped(fake_ray_package, monkeypatch, capsys):
    half_started = subprocess.Popen([sys.executable, str(fake_ray_package / "gcs_server.py")])
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    starts = []

    def init(**kwargs):
        starts.append(kwargs)
        if len(starts) == 1:
            raise TIMED_OUT

    monkeypatch.setattr(ray, "init", init)
    try:
        assert cluster.init_ray() == "local"
        assert len(starts) == 2 and starts[1]["address"] == "local"
        assert half_started.wait(timeout=10) is not None  # stopped before the second start
        assert unrelated.poll() is None  # not Ray's: left alone
        assert "starting it again (try 2 of 3)" in capsys.readouterr().err
    finally:
        for proc in (half_started, unrelated):
            proc.kill()
            proc.wait()


def test_it_gives_up_after_its_tries_with_rays_error(fake_ray_package, monkeypatch):
    starts = []

    def init(**kwargs):
        starts.append(kwargs)
        raise TIMED_OUT

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.init_ray()
    assert len(starts) == cluster.LOCAL_RAY_STARTS


def test_other_start_errors_are_not_tried_again(fake_ray_package, monkeypatch):
    starts = []

    def init(**kwargs):
        starts.append(kwargs)
        raise ValueError("num_cpus must be positive")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="num_cpus"):
        cluster.init_ray()
    assert len(starts) == 1
