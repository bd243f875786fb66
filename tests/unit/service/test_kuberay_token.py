"""Kueue mode's service-account token (`service.kuberay_jobs.KubeAPI`): the kubelet rotates a projected
token by swapping the `..data` symlink of the mounted volume, and the old token then stops working.
Every request reads the file again, so the launcher keeps working across rotations, including a
rewrite that keeps the file's mtime."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from service import kuberay_jobs
from service.kuberay_jobs import KubeAPIError, KubeRayJobLauncher
from tests.unit.service.test_kuberay_jobs import NS, template


class TokenCheckingAPI:
    """A Kubernetes API stand-in that accepts only the current token, and records the one each
    request presented."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.seen: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                got = self.headers.get("Authorization", "")
                api.seen.append(got)
                ok = got == f"Bearer {api.token}"
                body = (
                    {"kind": "RayJobList", "items": []} if ok else {"kind": "Status", "code": 401}
                )
                data = json.dumps(body).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class ProjectedVolume:
    """The kubelet's layout of a service-account volume: `token -> ..data/token`, `..data -> ..<ts>`;
    a rotation writes a new timestamped directory and swaps `..data` to it atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0
        root.mkdir()
        (root / "namespace").write_text(NS)
        self.rotate("token-1")
        (root / "token").symlink_to("..data/token")

    def rotate(self, token: str) -> None:
        self.n += 1
        d = self.root / f"..2026_01_01_00_00_0{self.n}"
        d.mkdir()
        (d / "token").write_text(token + "\n")
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(d.name)
        os.replace(tmp, self.root / "..data")


@pytest.fixture
def api() -> Iterator[TokenCheckingAPI]:
    a = TokenCheckingAPI("token-1")
    yield a
    a.server.shutdown()


def test_a_rotated_token_is_used_from_the_next_request_on(
    tmp_path: Path, api: TokenCheckingAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = ProjectedVolume(tmp_path / "serviceaccount")
    monkeypatch.setattr(kuberay_jobs, "SERVICE_ACCOUNT", volume.root)
    path = tmp_path / "rayjob-template.yaml"
    path.write_text(yaml.safe_dump(template()))
    launcher = KubeRayJobLauncher.from_file(
        str(path), api_url=api.url
    )  # as the control plane builds it
    assert launcher.namespace == NS

    assert launcher.cluster().per_job_clusters
    volume.rotate("token-2")  # the kubelet's rotation; the API stops taking the old token
    api.token = "token-2"
    assert launcher.cluster().per_job_clusters

    token_file = volume.root / "..data" / "token"  # rewritten in place, its mtime kept
    before = token_file.stat()
    token_file.write_text("token-3\n")
    os.utime(token_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    api.token = "token-3"
    assert launcher.cluster().per_job_clusters
    assert api.seen == ["Bearer token-1", "Bearer token-2", "Bearer token-3"]

    api.token = "token-4"  # not rotated on disk: refused, saying so
    with pytest.raises(KubeAPIError, match="HTTP 401"):
        launcher.cluster()
