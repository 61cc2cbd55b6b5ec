"""HTTP client of the fleet supervisor's admin API (used by the CLI, flows and tests)."""

from __future__ import annotations

import httpx


class FleetError(RuntimeError):
    def __init__(self, status: int, detail: str):
        super().__init__(f"fleet supervisor answered {status}: {detail}")
        self.status, self.detail = status, detail


class FleetClient:
    def __init__(self, url: str, token: str, timeout_s: float = 1800.0):
        # Long timeout: a scale-up or rolling restart returns only once replicas are verified.
        self.http = httpx.Client(base_url=url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})

    def _call(self, method: str, path: str, **kw) -> dict:
        r = self.http.request(method, path, **kw)
        if not r.is_success:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise FleetError(r.status_code, str(detail))
        return r.json()

    def status(self) -> dict:
        return self._call("GET", "/fleet")

    def scale(self, model: str, replicas: int) -> dict:
        return self._call("POST", f"/fleet/{model}/scale", json={"replicas": replicas})

    def deploy(self, model: str, version: str | int) -> dict:
        return self._call("POST", f"/fleet/{model}/deploy", json={"version": str(version)})

    def undeploy(self, model: str, version: str | int) -> dict:
        return self._call("POST", f"/fleet/{model}/undeploy", json={"version": str(version)})

    def replicas(self, model: str) -> list[dict]:
        return self.status()["models"][model]["replicas"]
