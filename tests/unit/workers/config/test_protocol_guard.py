"""The driver contract (workers/protocol.py) guards the fast tier lacked: the version check a driver
runs before anything else, the environment round trip between launcher and driver, and which job
states are terminal."""

from __future__ import annotations

import os
import re

import pytest

import workers.protocol as protocol
from workers.config import JobSpec
from workers.protocol import DriverEnv, JobState, VersionMismatch


def _env(ours: str = "1.4.0", ray: str = "2.40.0", **kw: object) -> DriverEnv:
    return DriverEnv(
        job_id="job-1",
        control_url="http://control:8000",
        ingest_token="tok",
        checkpoint_dir="/ckpt/job-1",
        job_spec=JobSpec(name="guard"),
        control_plane_version=ours,
        control_plane_ray_version=ray,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This driver runs ringtrain 1.4.0 on Ray 2.40.0."""
    monkeypatch.setattr(protocol, "ringtrain_version", lambda: "1.4.0")
    monkeypatch.setattr(protocol, "ray_version", lambda: "2.40.0")


def test_matching_or_unsent_versions_pass(installed: None) -> None:
    _env().check_version()
    _env(ours="", ray="").check_version()  # an older launcher sent none: nothing to compare


def test_another_ringtrain_release_is_refused(installed: None) -> None:
    with pytest.raises(VersionMismatch, match=re.escape("runs 1.4.0, the control plane 1.3.0")):
        _env(ours="1.3.0").check_version()


def test_another_ray_release_is_refused(installed: None) -> None:
    with pytest.raises(
        VersionMismatch, match=re.escape("runs Ray 2.40.0, the control plane Ray 2.9.0")
    ):
        _env(ray="2.9.0").check_version()


def test_a_driver_without_an_installed_version_compares_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(protocol, "ringtrain_version", lambda: "")
    monkeypatch.setattr(protocol, "ray_version", lambda: "")
    _env(ours="9.9.9", ray="9.9.9").check_version()


def test_the_launchers_environment_reads_back_as_the_same_driver_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent = _env(attempt=2, restarts=1, delivered_through=7, placement_timeout_s=30.5)
    env = sent.to_env()
    assert env["RINGTRAIN_DELIVERED_THROUGH"] == "7" and env["RINGTRAIN_ATTEMPT"] == "2"
    for key in [k for k in os.environ if k.startswith("RINGTRAIN_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    got = DriverEnv()  # type: ignore[call-arg]
    assert got.model_dump() == sent.model_dump()


def test_terminal_states() -> None:
    terminal = {s for s in JobState if s.terminal}
    assert terminal == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


def test_report_items_at_the_stores_bounds() -> None:
    """Times must be finite (an inf would break every event stream of the job) while a value may
    be NaN (a diverged loss is reported as such); ranks fit an INTEGER column; sequence numbers
    start at 1."""
    from pydantic import ValidationError

    from workers.protocol import MetricItem, MetricPoint

    point = {"step": 1, "name": "loss", "value": float("nan"), "time": 1.0}
    assert MetricPoint(**point).value != MetricPoint(**point).value  # NaN kept
    for bad_time in (float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="time"):
            MetricPoint(**{**point, "time": bad_time})
    assert MetricPoint(**point, rank=2**31 - 1).rank == 2**31 - 1
    with pytest.raises(ValidationError, match="rank"):
        MetricPoint(**point, rank=2**31)
    assert MetricItem(**point, seq=1).seq == 1
    with pytest.raises(ValidationError, match="seq"):
        MetricItem(**point, seq=0)
