# Chart versions, one place. Upgrade one at a time and read its release notes.
locals {
  charts = {
    kube_prometheus_stack = { repository = "https://prometheus-community.github.io/helm-charts", chart = "kube-prometheus-stack", version = "88.5.3" }
    nvidia_device_plugin  = { repository = "https://nvidia.github.io/k8s-device-plugin", chart = "nvidia-device-plugin", version = "0.20.0" }
    prefect_server        = { repository = "https://prefecthq.github.io/prefect-helm", chart = "prefect-server", version = "2026.8.18172642" }
    prefect_worker        = { repository = "https://prefecthq.github.io/prefect-helm", chart = "prefect-worker", version = "2026.8.18172642" }
    mlflow                = { repository = "https://community-charts.github.io/helm-charts", chart = "mlflow", version = "1.11.5" }
  }

  # Prefect server and worker images follow the Prefect the flows are written against
  # (requirements/platform.txt).
  prefect_version = "3.9.1"

  # In-cluster addresses (Service names are fixed by fullnameOverride below).
  prefect_host = "tidal-prefect-server.${var.namespace}.svc.cluster.local"
  mlflow_host  = "tidal-mlflow.${var.namespace}.svc.cluster.local"

  cpu_pool = { "tidal.dev/pool" = "cpu" }
}
