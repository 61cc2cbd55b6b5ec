variable "name_prefix" {
  description = "Prefix of role names (<prefix>-<workload>)."
  type        = string
}

variable "oidc_provider_arn" {
  description = "IAM OIDC provider of the EKS cluster."
  type        = string
}

variable "namespace" {
  description = "Kubernetes namespace of the Tidal service accounts."
  type        = string
}

variable "bucket_arns" {
  description = "Bucket ARN by purpose (logs, datasets, checkpoints, mlflow-artifacts)."
  type        = map(string)
}

variable "kms_key_arn" {
  description = "KMS key of the buckets."
  type        = string
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
