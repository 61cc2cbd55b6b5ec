variable "name_prefix" {
  description = "Prefix of resource names (<prefix>-<database>)."
  type        = string
}

variable "databases" {
  description = "One RDS instance per service: Prefect and MLflow both migrate an alembic_version table, so they cannot share a schema."
  type        = set(string)
}

variable "vpc_id" {
  description = "VPC of the instances."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets of the DB subnet group (at least two zones)."
  type        = list(string)
}

variable "client_security_group_id" {
  description = "Only this security group (the EKS nodes, whose pods are the clients) may connect."
  type        = string
}

variable "engine_version" {
  description = "PostgreSQL major version; minor versions are applied in the maintenance window."
  type        = string
}

variable "instance_class" {
  description = "RDS instance class."
  type        = string
}

variable "allocated_storage_gib" {
  description = "Initial storage; grows automatically up to 5x."
  type        = number
}

variable "multi_az" {
  description = "Standby in a second zone with automatic failover."
  type        = bool
}

variable "deletion_protection" {
  description = "Refuse to delete the instances (turn off before `terraform destroy`)."
  type        = bool
}

variable "backup_retention_days" {
  description = "Days of automated backups (point-in-time recovery window)."
  type        = number
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
