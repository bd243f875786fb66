"""`service.artifacts.resolve_artifact` refuses every name with a `..` part, also one that would
land back inside the model directory: a download names a listed file, nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.artifacts import ArtifactNotFound, resolve_artifact


def test_dotdot_parts_are_refused_even_when_they_stay_inside(tmp_path: Path) -> None:
    model = tmp_path / "job" / "model"
    (model / "extra").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    assert resolve_artifact(model, "config.json") == model / "config.json"
    for name in ("extra/../config.json", "../model/config.json"):
        with pytest.raises(ArtifactNotFound, match=r"without '\.\.'"):
            resolve_artifact(model, name)
