"""A Kubernetes API server on loopback for the calls the KubeRay launcher makes
(`service.kuberay_jobs`): create, get, list and delete RayJobs; list pods and read a log. It answers
as the API server does: 401 without the token, 409 for an existing name, 404, and 422 for an object
the RayJob CRD's schema refuses (the vendored KubeRay CRD, unknown fields rejected). Kueue and
KubeRay are played by the test changing a RayJob's `spec.suspend` and `status` (`set`), and the
submitter pod's log through `pods`."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.support import deploy_helpers as dh
from tests.support.api_harness import wait_for

NS = "ringtrain"
KUBE_TOKEN = "kube-sa-token-abc"


class KubeStub:
    def __init__(self) -> None:
        self.rayjobs: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, tuple[dict[str, str], str]] = {}  # name → (labels, log)
        self.pod_created: dict[str, str] = {}  # name → creationTimestamp, where a test sets one
        self.log_status = 200  # what reading a log answers (400: the container is not running)
        self.deleted: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (method, path) of every authenticated call
        self.reads: Counter[str] = (
            Counter()
        )  # GETs of each RayJob: one per reconciler pass while its job is active
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def answer(self, code: int, body: Any) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def route(self, method: str) -> None:
                if self.headers.get("Authorization") != f"Bearer {KUBE_TOKEN}":
                    return self.answer(
                        401, {"kind": "Status", "code": 401, "reason": "Unauthorized"}
                    )
                url = urlparse(self.path)
                body = json.loads(
                    self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null"
                )
                with stub.lock:
                    stub.calls.append((method, url.path))
                    code, out = stub.handle(method, url.path, parse_qs(url.query), body)
                self.answer(code, out)

            def do_GET(self) -> None:
                self.route("GET")

            def do_POST(self) -> None:
                self.route("POST")

            def do_DELETE(self) -> None:
                self.route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        rayjobs, pods = f"/apis/ray.io/v1/namespaces/{NS}/rayjobs", f"/api/v1/namespaces/{NS}/pods"
        name = path.rsplit("/", 1)[-1]
        if path == rayjobs and method == "GET":
            return 200, {"kind": "RayJobList", "items": list(self.rayjobs.values())}
        if path == rayjobs and method == "POST":
            if errors := dh.crd_errors(body):
                return 422, {
                    "kind": "Status",
                    "code": 422,
                    "reason": "Invalid",
                    "message": "; ".join(errors),
                }
            if body["metadata"]["name"] in self.rayjobs:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
            body["metadata"].update(
                namespace=NS, creationTimestamp="2026-11-29T00:00:00Z", generation=1
            )
            self.rayjobs[body["metadata"]["name"]] = body
            return 201, body
        if path.startswith(rayjobs + "/"):
            if name not in self.rayjobs:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if method == "DELETE":
                self.deleted.append(name)
                return 200, self.rayjobs.pop(name)
            self.reads[name] += 1
            return 200, self.rayjobs[name]
        if path == pods:
            key, _, want = query["labelSelector"][0].partition("=")
            return 200, {
                "items": [
                    {"metadata": {"name": n, "labels": lb, **self._created(n)}}
                    for n, (lb, _) in self.pods.items()
                    if lb.get(key) == want
                ]
            }
        if path.startswith(pods + "/") and path.endswith("/log"):
            return self.log_status, self.pods[path.split("/")[-2]][1]
        return 404, {"kind": "Status", "code": 404}

    def _created(self, pod: str) -> dict[str, str]:
        when = self.pod_created.get(pod)
        return {} if when is None else {"creationTimestamp": when}

    def set(self, name: str, *, suspend: bool = False, **status: str) -> None:
        """Play Kueue (admission: suspend false; preemption: true again) and KubeRay (status). A spec change bumps
        `metadata.generation`, as the API server does for a CRD with a status subresource (status changes don't)."""
        with self.lock:
            job = self.rayjobs[name]
            if job["spec"]["suspend"] != suspend:
                job["spec"]["suspend"] = suspend
                job["metadata"]["generation"] += 1
            job["status"] = status

    def passes(self, name: str, n: int = 2) -> None:
        """Wait until the reconciler has read the RayJob `n` more times: at least `n - 1` whole passes saw its
        current state."""
        with self.lock:
            target = self.reads[name] + n
        wait_for(lambda: self.reads[name] >= target, timeout=30)

    def created(self, job_id: str) -> list[str]:
        with self.lock:
            return sorted(
                n
                for n, j in self.rayjobs.items()
                if j["metadata"]["labels"].get("ringtrain.io/job-id") == job_id
            )
