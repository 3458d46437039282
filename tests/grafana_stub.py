"""A loopback stand-in for Grafana's annotation API that validates every request against
the excerpt of Grafana's published OpenAPI spec kept in infra/grafana/openapi/.

Requests that do not match the spec (path, method, query, body, missing Authorization)
are answered 400 and recorded in ``violations``; a wrong token gets 401 like Grafana;
``fail_next`` makes the next requests fail with a given status (e.g. 503) after they
passed validation, and ``delay_s`` makes every answer slow.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

from openapi_core import OpenAPI
from openapi_core.contrib.werkzeug import WerkzeugOpenAPIRequest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

SPEC = Path(__file__).resolve().parents[1] / "infra" / "grafana" / "openapi" / "annotations-openapi3.json"
ONE = re.compile(r"^/api/annotations/(\d+)$")


class GrafanaStub:
    def __init__(self, token: str = "glsa_test_token"):
        self.openapi = OpenAPI.from_file_path(str(SPEC))
        self.token = token
        self.annotations: dict[int, dict] = {}
        self.requests: list[tuple[str, str, dict | None, str | None]] = []  # method, path, body, auth
        self.violations: list[str] = []
        self.fail_next: list[int] = []
        self.delay_s = 0.0
        self._next_id = 1
        self._lock = threading.Lock()
        self._server = make_server("127.0.0.1", 0, self._app, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "GrafanaStub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- WSGI --------------------------------------------------------------------------

    def _app(self, environ, start_response):
        request = Request(environ)
        response = self._handle(request)
        return response(environ, start_response)

    def _handle(self, request: Request) -> Response:
        body = request.get_json(silent=True) if request.data else None
        auth = request.headers.get("Authorization")
        with self._lock:
            self.requests.append((request.method, request.full_path.rstrip("?"), body, auth))
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            self.openapi.validate_request(WerkzeugOpenAPIRequest(request))
        except Exception as exc:  # any mismatch with the published spec
            detail = f"{request.method} {request.full_path}: {type(exc).__name__}: {exc}"
            with self._lock:
                self.violations.append(detail)
            return _json({"message": f"request does not match Grafana's OpenAPI spec: {detail}"}, 400)
        if auth != f"Bearer {self.token}":
            return _json({"message": "Unauthorized"}, 401)
        with self._lock:
            if self.fail_next:
                return _json({"message": "Service unavailable"}, self.fail_next.pop(0))
            return self._route(request, body)

    def _route(self, request: Request, body) -> Response:
        path, method = request.path, request.method
        if path == "/api/annotations" and method == "POST":
            ann_id = self._next_id
            self._next_id += 1
            self.annotations[ann_id] = {"id": ann_id, "time": body.get("time", 0),
                                        "timeEnd": body.get("timeEnd", body.get("time", 0)),
                                        "text": body["text"], "tags": body.get("tags", []),
                                        "dashboardUID": body.get("dashboardUID", "")}
            return _json({"id": ann_id, "message": "Annotation added"})
        if path == "/api/annotations" and method == "GET":
            tags = request.args.getlist("tags")
            found = [a for a in self.annotations.values() if all(t in a["tags"] for t in tags)]
            found.sort(key=lambda a: -a["id"])
            limit = request.args.get("limit", type=int)
            return _json(found[:limit] if limit else found)
        match = ONE.match(path)
        if match and int(match.group(1)) in self.annotations:
            ann = self.annotations[int(match.group(1))]
            if method in ("PATCH", "PUT"):
                for key in ("time", "timeEnd", "text", "tags"):
                    if key in body:
                        ann[key] = body[key]
                return _json({"message": "Annotation patched"})
            if method == "GET":
                return _json(ann)
        return _json({"message": "Annotation not found"}, 404)

    # -- for assertions -------------------------------------------------------------------

    def by_tag(self, tag: str) -> list[dict]:
        return [a for a in self.annotations.values() if tag in a["tags"]]


def _json(data, status: int = 200) -> Response:
    return Response(json.dumps(data), status=status, mimetype="application/json")
