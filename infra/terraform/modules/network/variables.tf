variable "name" {
  description = "Name of the VPC and prefix of its resources (tidal-<prefix>)."
  type        = string
}

variable "cidr" {
  description = "IPv4 range of the VPC."
  type        = string
}

variable "az_count" {
  description = "Availability zones to spread subnets (and NAT gateways) over."
  type        = number
}

variable "single_nat_gateway" {
  description = "One NAT gateway for all zones (cheaper) instead of one per zone (survives a zone outage)."
  type        = bool
}

variable "cluster_name" {
  description = "EKS cluster name, written into subnet tags so load balancers find their subnets."
  type        = string
}

variable "flow_log_retention_days" {
  description = "Days VPC flow logs are kept in CloudWatch."
  type        = number
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
