output "gateway_url" {
  description = "Base URL of the OpenAI-compatible gateway (the SDK's base_url is this + /v1). Empty until its load balancer has a name."
  value       = module.platform.gateway_url
}

output "prefect_ui_url" {
  description = "Prefect UI, after prefect_port_forward_command (Prefect has no login, so it is not exposed)."
  value       = "http://localhost:4200"
}

output "prefect_port_forward_command" {
  description = "Forwards the Prefect UI and API to localhost:4200."
  value       = "kubectl -n ${var.namespace} port-forward svc/tidal-prefect-server 4200:4200"
}

output "mlflow_url" {
  description = "MLflow UI, after mlflow_port_forward_command (MLflow has no login, so it is not exposed)."
  value       = "http://localhost:5000"
}

output "mlflow_port_forward_command" {
  description = "Forwards the MLflow UI and API to localhost:5000."
  value       = "kubectl -n ${var.namespace} port-forward svc/tidal-mlflow 5000:80"
}

output "grafana_port_forward_command" {
  description = "Forwards Grafana to localhost:3000; the admin password is in the secret named by grafana_admin_secret."
  value       = "kubectl -n monitoring port-forward svc/tidal-monitoring-grafana 3000:80"
}

output "grafana_admin_secret" {
  description = "namespace/name of the Kubernetes secret with Grafana's admin user and password."
  value       = module.platform.grafana_admin_secret
}

output "prefect_api_url_in_cluster" {
  description = "PREFECT_API_URL for pods in the cluster."
  value       = module.platform.prefect_api_url_in_cluster
}

output "mlflow_tracking_uri_in_cluster" {
  description = "MLFLOW_TRACKING_URI for pods in the cluster."
  value       = module.platform.mlflow_url_in_cluster
}

output "prefect_work_pool" {
  description = "Kubernetes work pool served by the Prefect worker."
  value       = module.platform.prefect_work_pool
}

output "bucket_names" {
  description = "S3 bucket by purpose: logs, datasets, checkpoints, mlflow-artifacts."
  value       = module.storage.bucket_names
}

output "storage_kms_key_arn" {
  description = "KMS key encrypting the buckets."
  value       = module.storage.kms_key_arn
}

output "iam_role_arns" {
  description = "IRSA role by workload (gateway, trainer, mlflow, flows, fleet)."
  value       = module.irsa.role_arns
}

output "database_secret_arns" {
  description = "Secrets Manager secrets with each database's credentials."
  value       = module.database.secret_arns
}

output "cluster_name" {
  description = "EKS cluster name."
  value       = module.cluster.cluster_name
}

output "kubeconfig_command" {
  description = "Adds the cluster to ~/.kube/config for kubectl and helm."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.cluster_name}"
}
