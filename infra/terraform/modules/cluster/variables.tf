variable "name" {
  description = "EKS cluster name."
  type        = string
}

variable "kubernetes_version" {
  description = "Kubernetes <major>.<minor> of the control plane and node groups."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the cluster."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets for the control plane ENIs and the nodes."
  type        = list(string)
}

variable "endpoint_public_access_cidrs" {
  description = "Networks allowed to reach the public Kubernetes API endpoint (where terraform, helm and kubectl run)."
  type        = list(string)
}

variable "log_retention_days" {
  description = "Days control-plane logs are kept in CloudWatch."
  type        = number
}

variable "node_groups" {
  description = "Node pools by role: cpu (gateway, Prefect, MLflow, monitoring), fleet (vLLM) and training (PPO jobs)."
  type = object({
    cpu = object({
      instance_types = list(string)
      min_size       = number
      max_size       = number
      desired_size   = number
      disk_size_gib  = number
    })
    fleet = object({
      instance_types = list(string)
      min_size       = number
      max_size       = number
      desired_size   = number
      disk_size_gib  = number
    })
    training = object({
      instance_types = list(string)
      min_size       = number
      max_size       = number
      desired_size   = number
      disk_size_gib  = number
    })
  })
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
