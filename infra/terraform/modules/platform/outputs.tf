locals {
  gateway_lb = try(data.kubernetes_service_v1.gateway.status[0].load_balancer[0].ingress[0].hostname, "")
}

output "gateway_url" {
  description = "OpenAI-compatible base URL of the gateway (append /v1 for the SDK)."
  value       = local.gateway_lb == "" ? "" : "${local.gateway_port == 443 ? "https" : "http"}://${local.gateway_lb}"
}

output "prefect_api_url_in_cluster" {
  description = "Prefect API URL for pods in the cluster."
  value       = "http://${local.prefect_host}:4200/api"
}

output "mlflow_url_in_cluster" {
  description = "MLflow tracking URI for pods in the cluster."
  value       = "http://${local.mlflow_host}"
}

output "prefect_work_pool" {
  description = "Kubernetes work pool the Prefect worker polls."
  value       = "tidal-kubernetes"
}

output "grafana_admin_secret" {
  description = "Namespace/name of the secret holding Grafana's admin password."
  value       = "${var.monitoring_namespace}/${kubernetes_secret_v1.grafana_admin.metadata[0].name}"
}
