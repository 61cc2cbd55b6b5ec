# ---- Required ---------------------------------------------------------------------------------

variable "region" {
  description = "AWS region of the whole platform."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region code such as us-east-1 or eu-west-2."
  }
}

variable "cluster_endpoint_public_access_cidrs" {
  description = "Networks allowed to reach the Kubernetes API (where terraform, helm and kubectl run), e.g. your office or VPN egress."
  type        = list(string)

  validation {
    condition     = length(var.cluster_endpoint_public_access_cidrs) > 0 && alltrue([for c in var.cluster_endpoint_public_access_cidrs : can(cidrhost(c, 0))])
    error_message = "cluster_endpoint_public_access_cidrs must list at least one valid CIDR block (a.b.c.d/n)."
  }

  validation {
    condition     = !contains(var.cluster_endpoint_public_access_cidrs, "0.0.0.0/0")
    error_message = "cluster_endpoint_public_access_cidrs must not contain 0.0.0.0/0: name the networks that administer the cluster."
  }
}

variable "tidal_image" {
  description = "Image of this repository (requirements/platform.txt installed) for the gateway and Prefect flow runs, in a registry the nodes can pull from (e.g. ECR)."
  type = object({
    repository = string
    tag        = string
  })

  validation {
    condition     = var.tidal_image.repository != "" && var.tidal_image.tag != "" && var.tidal_image.tag != "latest"
    error_message = "tidal_image needs a repository and an immutable tag (not \"latest\"), so every node runs the same code."
  }
}

variable "models" {
  description = <<-EOT
    Served models, one vLLM Deployment each:
      name              registered model name (lowercase letters, digits, '-')
      replicas          vLLM pods
      update_strategy   how new versions reach the replicas: lora | restart | reload | nccl
      model_uri         unused with the fleet supervisor (the default): each model serves its registry version
                        (`tidal import` registers one first, infra/README.md); only the chart's static engines read it
      instance_type     GPU instance type for its pods; must be one of fleet_node_group.instance_types
      gpus              GPUs per pod (tensor parallel size), default 1
      served_model_name --served-model-name, default name
  EOT
  type = list(object({
    name              = string
    replicas          = number
    update_strategy   = string
    model_uri         = optional(string, "")
    instance_type     = string
    gpus              = optional(number, 1)
    served_model_name = optional(string)
  }))

  validation {
    condition     = length(var.models) > 0
    error_message = "models must list at least one model."
  }

  validation {
    condition     = alltrue([for m in var.models : contains(["lora", "restart", "reload", "nccl"], m.update_strategy)])
    error_message = "models[*].update_strategy must be one of lora, restart, reload, nccl (got: ${join(", ", [for m in var.models : "${m.name}=${m.update_strategy}"])})."
  }

  validation {
    condition     = alltrue([for m in var.models : can(regex("^[a-z][a-z0-9-]{0,40}$", m.name))])
    error_message = "models[*].name must start with a letter and hold only lowercase letters, digits and '-' (at most 41 characters): it names Kubernetes objects."
  }

  validation {
    condition     = length(distinct([for m in var.models : m.name])) == length(var.models)
    error_message = "models[*].name must be unique."
  }

  validation {
    condition     = alltrue([for m in var.models : m.replicas >= 0 && floor(m.replicas) == m.replicas && m.gpus >= 1 && floor(m.gpus) == m.gpus])
    error_message = "models[*].replicas must be a whole number >= 0 and models[*].gpus a whole number >= 1."
  }

  validation {
    condition     = alltrue([for m in var.models : contains(var.fleet_node_group.instance_types, m.instance_type)])
    error_message = "models[*].instance_type must be one of fleet_node_group.instance_types, or its pods can never be scheduled."
  }
}

variable "gateway_clients" {
  description = "API clients of the gateway: [{client_id, key}] with keys of 16+ characters. A secret: set it outside version control (TF_VAR_gateway_clients)."
  type = list(object({
    client_id = string
    key       = string
  }))
  sensitive = true

  validation {
    # Without configured clients each gateway pod would invent its own key on every start.
    condition     = length(var.gateway_clients) > 0
    error_message = "gateway_clients must list at least one API client, e.g. TF_VAR_gateway_clients='[{\"client_id\":\"editor\",\"key\":\"<32+ random characters>\"}]'."
  }

  validation {
    condition     = alltrue([for c in var.gateway_clients : can(regex("^[A-Za-z0-9_.-]{1,64}$", c.client_id)) && length(c.key) >= 16])
    error_message = "gateway_clients: client_id must be 1-64 of [A-Za-z0-9_.-] and key at least 16 characters."
  }
}

# ---- Naming and network -----------------------------------------------------------------------

variable "name_prefix" {
  description = "Prefix of every resource name (tidal-<component> by default); also the EKS cluster name."
  type        = string
  default     = "tidal"

  validation {
    # Bucket names are <prefix>-<account>-<region>-mlflow-artifacts and must stay within 63 characters.
    condition     = can(regex("^[a-z][a-z0-9-]{1,15}$", var.name_prefix))
    error_message = "name_prefix must be 2-16 characters: lowercase letters, digits and '-', starting with a letter."
  }
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = {}
}

variable "vpc_cidr" {
  description = "IPv4 range of the VPC (/16 to /20)."
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 20
    error_message = "vpc_cidr must be a valid CIDR block between /16 and /20."
  }
}

variable "az_count" {
  description = "Availability zones used (subnets, NAT gateways, database standby)."
  type        = number
  default     = 3

  validation {
    condition     = var.az_count >= 2 && var.az_count <= 6
    error_message = "az_count must be between 2 and 6 (EKS and RDS need two zones at least)."
  }
}

variable "single_nat_gateway" {
  description = "One shared NAT gateway (cheaper) instead of one per zone (keeps egress through a zone outage)."
  type        = bool
  default     = false
}

# ---- Cluster ----------------------------------------------------------------------------------

variable "kubernetes_version" {
  description = "Kubernetes <major>.<minor> of the EKS control plane and nodes."
  type        = string
  default     = "1.34"

  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.34."
  }
}

variable "cpu_node_group" {
  description = "CPU pool: gateway, Prefect, MLflow, monitoring."
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = optional(number, 100)
  })
  default = {
    instance_types = ["m7i.xlarge"]
    min_size       = 2
    max_size       = 6
    desired_size   = 3
  }

  validation {
    condition = (length(var.cpu_node_group.instance_types) > 0 && var.cpu_node_group.min_size >= 1 &&
    var.cpu_node_group.min_size <= var.cpu_node_group.desired_size && var.cpu_node_group.desired_size <= var.cpu_node_group.max_size)
    error_message = "cpu_node_group needs instance types and 1 <= min_size <= desired_size <= max_size (the platform services always need a node)."
  }
}

variable "fleet_node_group" {
  description = "GPU pool of the vLLM fleet (tainted nvidia.com/gpu=true:NoSchedule, labelled tidal.dev/pool=fleet)."
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = optional(number, 300)
  })
  default = {
    instance_types = ["g6e.xlarge"]
    min_size       = 1
    max_size       = 8
    desired_size   = 2
  }

  validation {
    condition = (length(var.fleet_node_group.instance_types) > 0 && var.fleet_node_group.min_size >= 0 &&
    var.fleet_node_group.min_size <= var.fleet_node_group.desired_size && var.fleet_node_group.desired_size <= var.fleet_node_group.max_size)
    error_message = "fleet_node_group needs instance types and 0 <= min_size <= desired_size <= max_size."
  }
}

variable "training_node_group" {
  description = "GPU pool of PPO training jobs (tainted nvidia.com/gpu=true:NoSchedule, labelled tidal.dev/pool=training). min/desired 0 costs nothing while no job runs."
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = optional(number, 500)
  })
  default = {
    instance_types = ["g6e.12xlarge"]
    min_size       = 0
    max_size       = 2
    desired_size   = 0
  }

  validation {
    condition = (length(var.training_node_group.instance_types) > 0 && var.training_node_group.min_size >= 0 &&
    var.training_node_group.min_size <= var.training_node_group.desired_size && var.training_node_group.desired_size <= var.training_node_group.max_size)
    error_message = "training_node_group needs instance types and 0 <= min_size <= desired_size <= max_size."
  }
}

variable "log_retention_days" {
  description = "Days EKS control-plane logs and VPC flow logs are kept in CloudWatch."
  type        = number
  default     = 90

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch Logs retention value (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, ...)."
  }
}

# ---- Gateway and images -----------------------------------------------------------------------

variable "gateway_min_replicas" {
  description = "Fewest gateway pods (HorizontalPodAutoscaler)."
  type        = number
  default     = 1

  validation {
    condition     = var.gateway_min_replicas >= 1
    error_message = "gateway_min_replicas must be at least 1."
  }
}

variable "gateway_max_replicas" {
  description = "Most gateway pods. The route table lives in each gateway process today, so canary weights reach only the pod that was told: keep 1 until routes are shared."
  type        = number
  default     = 1

  validation {
    condition     = var.gateway_max_replicas >= var.gateway_min_replicas
    error_message = "gateway_max_replicas must be >= gateway_min_replicas."
  }
}

variable "gateway_allowed_cidrs" {
  description = "Networks allowed to reach the gateway's load balancer (clients authenticate with API keys). Required: name them; [\"0.0.0.0/0\"] (a public API) needs TLS."
  type        = list(string)

  validation {
    condition     = length(var.gateway_allowed_cidrs) > 0 && alltrue([for c in var.gateway_allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "gateway_allowed_cidrs must list at least one valid CIDR block."
  }
  validation {
    condition     = var.gateway_certificate_arn != "" || !contains(var.gateway_allowed_cidrs, "0.0.0.0/0")
    error_message = "gateway_allowed_cidrs contains 0.0.0.0/0 while the gateway serves plain HTTP: API keys would cross the internet in clear text. Set gateway_certificate_arn, or name the private networks that call it."
  }
}

variable "gateway_certificate_arn" {
  description = "ACM certificate for TLS on the gateway's load balancer (port 443). Required unless gateway_allow_plain_http is set."
  type        = string

  validation {
    condition     = var.gateway_certificate_arn == "" || can(regex("^arn:aws[a-z-]*:acm:", var.gateway_certificate_arn))
    error_message = "gateway_certificate_arn must be an ACM certificate ARN (arn:aws:acm:...) or empty."
  }
  validation {
    condition     = var.gateway_certificate_arn != "" || var.gateway_allow_plain_http
    error_message = "gateway_certificate_arn is empty: clients send API keys to the gateway, so it serves TLS. Pass an ACM certificate ARN, or set gateway_allow_plain_http = true for a stack reached only from private networks."
  }
}

variable "gateway_allow_plain_http" {
  description = "Serve the gateway over plain HTTP (port 80) when no certificate is given: only for a stack reached from private networks (gateway_allowed_cidrs may then not contain 0.0.0.0/0)."
  type        = bool
  default     = false
}

variable "gateway_storage" {
  description = "Persistent volume of each gateway pod: its write-ahead log (records not uploaded yet) and route table survive a pod's restart or rescheduling. storage_class \"\" = the cluster's default."
  type = object({
    size          = optional(string, "10Gi")
    storage_class = optional(string, "")
  })
  default = {}

  validation {
    condition     = can(regex("^[0-9]+(Mi|Gi|Ti)$", var.gateway_storage.size))
    error_message = "gateway_storage.size must be a quantity like 10Gi."
  }
}

variable "tidal_settings" {
  description = <<-EOT
    Tidal settings (tidal.yaml sections, e.g. collect, train, canary, flywheel) merged over the ones this stack sets,
    key by key (Helm merges the values), into the `tidal-settings` ConfigMap every Tidal pod reads. The stack sets
    data_dir, store, prefect, mlflow, fleet, engine and the models; `models` comes from var.models and credentials
    from Secrets, so neither may be given here. infra/examples/aws.tidal.yaml shows a whole file.
  EOT
  type        = any
  default     = {}

  validation {
    condition     = length(setintersection(keys(var.tidal_settings), ["models", "admin_token", "gateway_clients"])) == 0
    error_message = "tidal_settings may not set models (use var.models) or admin_token/gateway_clients (Secrets: var.gateway_clients)."
  }
}

variable "vllm_image" {
  description = "vLLM OpenAI-server image (CUDA build) of the fleet: infra/docker/engine.Dockerfile, which runs it non-root."
  type = object({
    repository = string
    tag        = string
  })
  default = {
    repository = "vllm/vllm-openai"
    tag        = "v0.32.0"
  }

  validation {
    condition     = var.vllm_image.repository != "" && var.vllm_image.tag != "" && var.vllm_image.tag != "latest"
    error_message = "vllm_image needs a repository and an immutable tag (not \"latest\")."
  }
}

# ---- Data -------------------------------------------------------------------------------------

variable "database_instance_class" {
  description = "RDS instance class of each Postgres (Prefect, MLflow)."
  type        = string
  default     = "db.t4g.medium"

  validation {
    condition     = startswith(var.database_instance_class, "db.")
    error_message = "database_instance_class must be an RDS class such as db.t4g.medium."
  }
}

variable "postgres_version" {
  description = "PostgreSQL major version of the RDS instances."
  type        = string
  default     = "17"

  validation {
    condition     = can(regex("^1[4-9]$", var.postgres_version))
    error_message = "postgres_version must be a major version from 14 to 19."
  }
}

variable "database_multi_az" {
  description = "Keep a standby of each database in a second zone with automatic failover."
  type        = bool
  default     = true
}

variable "database_deletion_protection" {
  description = "Refuse to delete the databases; set false (and apply) before `terraform destroy`."
  type        = bool
  default     = true
}

variable "database_backup_retention_days" {
  description = "Days of automated database backups (point-in-time recovery window)."
  type        = number
  default     = 7

  validation {
    condition     = var.database_backup_retention_days >= 1 && var.database_backup_retention_days <= 35
    error_message = "database_backup_retention_days must be between 1 and 35 (0 would turn backups off)."
  }
}

variable "logs_transition_days" {
  description = "Days after which logged completions and feedback move to S3 Standard-IA."
  type        = number
  default     = 30

  validation {
    condition     = var.logs_transition_days >= 30
    error_message = "logs_transition_days must be at least 30 (S3 minimum for Standard-IA transitions)."
  }
}

variable "logs_expiration_days" {
  description = "Days after which logged completions and feedback are deleted."
  type        = number
  default     = 365

  validation {
    condition     = var.logs_expiration_days > var.logs_transition_days
    error_message = "logs_expiration_days must be greater than logs_transition_days."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Days an overwritten or deleted object version stays recoverable."
  type        = number
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "force_destroy_buckets" {
  description = "Let `terraform destroy` delete buckets that still hold objects. Only for throw-away stacks."
  type        = bool
  default     = false
}

# ---- Platform services ------------------------------------------------------------------------

variable "namespace" {
  description = "Kubernetes namespace of Tidal, Prefect and MLflow (IRSA roles trust service accounts in it)."
  type        = string
  default     = "tidal"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a Kubernetes name (lowercase letters, digits, '-')."
  }
}

variable "prometheus_retention" {
  description = "How long Prometheus keeps samples (Prometheus duration, e.g. 15d)."
  type        = string
  default     = "15d"

  validation {
    condition     = can(regex("^[0-9]+(h|d|w|y)$", var.prometheus_retention))
    error_message = "prometheus_retention must be a duration such as 15d or 4w."
  }
}

variable "helm_timeout_s" {
  description = "Seconds each Helm release may take to become ready; vLLM pods load weights first."
  type        = number
  default     = 1800

  validation {
    condition     = var.helm_timeout_s >= 300
    error_message = "helm_timeout_s must be at least 300."
  }
}
