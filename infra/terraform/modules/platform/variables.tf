variable "namespace" {
  description = "Namespace of the Tidal workloads, Prefect and MLflow."
  type        = string
}

variable "monitoring_namespace" {
  description = "Namespace of kube-prometheus-stack."
  type        = string
}

variable "region" {
  description = "AWS region (S3 client region of the Tidal settings)."
  type        = string
}

variable "bucket_names" {
  description = "Bucket name by purpose (logs, datasets, checkpoints, mlflow-artifacts)."
  type        = map(string)
}

variable "role_arns" {
  description = "IRSA role ARN by workload (gateway, trainer, mlflow, flows, fleet)."
  type        = map(string)
}

variable "databases" {
  description = "Postgres host of each service (prefect, mlflow)."
  type        = map(string)
}

variable "database_credentials" {
  description = "Username and password of each service's database."
  type        = map(object({ username = string, password = string }))
  sensitive   = true
}

variable "models" {
  description = "Served models (see the root variable `models`)."
  type = list(object({
    name              = string
    replicas          = number
    update_strategy   = string
    model_uri         = optional(string, "")
    instance_type     = string
    gpus              = number
    served_model_name = optional(string)
  }))
}

variable "tidal_image" {
  description = "Tidal image repository and tag."
  type        = object({ repository = string, tag = string })
}

variable "tidal_settings" {
  description = "Tidal settings merged over the ones this module sets (see the root variable `tidal_settings`)."
  type        = any
  default     = {}
}

variable "vllm_image" {
  description = "vLLM OpenAI-server image repository and tag."
  type        = object({ repository = string, tag = string })
}

variable "gateway" {
  description = "Gateway replicas, who may reach it, the ACM certificate for TLS on the load balancer (\"\": plain HTTP, checked at the root), and each pod's persistent volume."
  type = object({
    min_replicas    = number
    max_replicas    = number
    allowed_cidrs   = list(string)
    certificate_arn = string
    storage         = object({ size = string, storage_class = string })
  })
}

variable "gateway_clients" {
  description = "API clients of the gateway ({client_id, key})."
  type        = list(object({ client_id = string, key = string }))
  sensitive   = true
}

variable "prometheus_retention" {
  description = "How long Prometheus keeps samples."
  type        = string
}

variable "helm_timeout_s" {
  description = "How long each Helm release may take to become ready (vLLM loads weights before it is ready)."
  type        = number
}
