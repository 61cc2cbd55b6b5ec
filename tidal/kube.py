"""What every Kubernetes-facing part shares (the trainer launcher, the fleet's runtime, the flows' work pool):
the image rule of pods a controller may recreate, resource quantities, the GPU resource and its taint's
toleration, and the API client from a pod's token or a kubeconfig. A leaf: it imports no component."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tidal.section import Section

GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"  # Kubernetes memory/storage quantities
_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity_bytes(q: str) -> float:
    """'32Gi' -> 34359738368.0 (only the forms QUANTITY admits)."""
    digits = q.rstrip("KMGTPEik")
    return float(digits) * _UNITS[q[len(digits) :]]


class Toleration(Section):
    key: str = Field(..., description="Taint key tolerated, e.g. nvidia.com/gpu.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: the taint's value must match; Exists: any value.")
    value: str | None = Field(None, description="Taint value (with operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(None, description="Taint effect; None = all.")


def gpu_toleration() -> list[Toleration]:
    """The taint infra/terraform puts on the fleet and training GPU node groups (modules/cluster: gpu_taint)."""
    return [Toleration(key=GPU_RESOURCE, operator="Equal", value="true", effect="NoSchedule")]


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
