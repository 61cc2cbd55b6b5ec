variable "name_prefix" {
  description = "Prefix of bucket names: <prefix>-<account id>-<region>-<bucket> (bucket names are global)."
  type        = string
}

variable "logs_transition_days" {
  description = "Days after which completion/feedback logs move to STANDARD_IA (collect reads them within hours)."
  type        = number
}

variable "logs_expiration_days" {
  description = "Days after which logs are deleted; reward datasets built from them stay in the datasets bucket."
  type        = number
}

variable "noncurrent_version_expiration_days" {
  description = "Days an overwritten or deleted object version is kept (recovery window after a bad write)."
  type        = number
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete non-empty buckets. Keep false outside throw-away stacks."
  type        = bool
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
