"""Which versions of a model the gateway's route table sends traffic to: what the supervisor must not unload.

The gateway owns the route table; the supervisor asks it (GET /admin/routes). A gateway that does not answer
still routes by its table file when it comes back, so the supervisor then reads the file the gateway persists
(local platforms share the data directory; on Kubernetes the file is the gateway's, and a supervisor that cannot
reach any gateway sees only the serving version). A file that cannot be read refuses the unload. A model without
routes is served its fleet's serving version, which is then the one in use.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from serving.client import AdminError, RoutesClient
from serving.routes import RouteError, RouteTable


class RoutedVersion(RuntimeError):
    """The version to unload gets traffic from the route table (HTTP 409)."""


class RoutesUnknown(RuntimeError):
    """Neither the gateway nor its route table file could say what gets traffic (HTTP 503)."""


class RouteGuard:
    def __init__(self, gateway_url: str, admin_token: str, table_path: Path, timeout_s: float = 5.0):
        self.gateway_url, self.table_path = gateway_url, Path(table_path)
        # no retries: a gateway that does not answer at once is read from its file instead
        self._client = RoutesClient(gateway_url, admin_token, timeout_s=timeout_s, retry_delays_s=())

    def routed_versions(self, model: str, serving_version: int | None) -> set[int]:
        """Versions named by the model's arms, or {serving_version} when it has none."""
        try:
            routes = self._client.show().get(model)
            arms = routes.arms if routes else None
        except (AdminError, httpx.HTTPError) as gateway_error:
            # No file: no route was ever set on this data directory, so a gateway routes by the serving version.
            try:
                found = RouteTable(self.table_path).get(model) if self.table_path.is_file() else None
            except RouteError as e:
                raise RoutesUnknown(
                    f"cannot confirm that no traffic goes to it: the gateway at {self.gateway_url} did "
                    f"not answer ({type(gateway_error).__name__}) and {e}; start the gateway, or unload "
                    "with force"
                ) from None
            arms = found.arms if found else None
        if arms is None:
            return {serving_version} if serving_version else set()
        return {a.version for a in arms}

    def check_unload(self, model: str, version: int, served_name: str, serving_version: int | None) -> None:
        if version in self.routed_versions(model, serving_version):
            raise RoutedVersion(
                f"{served_name} still gets traffic from the gateway's route table: route it away first "
                f"(`tidal route rollback {model}` or `tidal route show`), then unload it"
            )
