"""What every Kubernetes-facing part shares (the trainer launcher, the fleet's runtime, the flows' work pool):
the image rule of pods a controller may recreate, and the API client from a pod's token or a kubeconfig."""

from __future__ import annotations

from typing import Any


def unpinned(setting: str, image: str) -> str | None:
    """Why `image` cannot be used by pods a controller may recreate at any time (a retried or rescheduled pod
    must run the same code), or None."""
    last = image.rsplit("/", 1)[-1]
    if not image:
        return f"set {setting} (repository:tag or @sha256 digest, pushed where the nodes pull from)"
    if "@" not in last and (":" not in last or last.endswith(":latest")):
        return f"{setting} {image!r} has no fixed tag: use an immutable tag or @sha256 digest, not latest"
    return None


def api_client(context: str | None, error: type[Exception], who: str, fix: str) -> Any:
    """A kubernetes ApiClient: the pod's service account token inside a cluster, else the kubeconfig `context`.
    Without either, raises `error` naming `who` needs it and `fix`."""
    from kubernetes import client, config

    conf = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=conf)  # a pod's service account token
        return client.ApiClient(conf)
    except config.ConfigException:
        try:
            return config.new_client_from_config(context=context, persist_config=False)
        except (config.ConfigException, OSError) as e:
            raise error(f"no Kubernetes credentials for {who} ({e}): {fix}") from e
