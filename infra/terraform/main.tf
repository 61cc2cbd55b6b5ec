locals {
  cluster_name = var.name_prefix
  tags = merge(var.tags, {
    "app.kubernetes.io/part-of" = "tidal"
    "tidal.dev/stack"           = var.name_prefix
  })
}

module "network" {
  source = "./modules/network"

  name                    = var.name_prefix
  cidr                    = var.vpc_cidr
  az_count                = var.az_count
  single_nat_gateway      = var.single_nat_gateway
  cluster_name            = local.cluster_name
  flow_log_retention_days = var.log_retention_days
  tags                    = local.tags
}

module "cluster" {
  source = "./modules/cluster"

  name                         = local.cluster_name
  kubernetes_version           = var.kubernetes_version
  vpc_id                       = module.network.vpc_id
  subnet_ids                   = module.network.private_subnet_ids
  endpoint_public_access_cidrs = var.cluster_endpoint_public_access_cidrs
  log_retention_days           = var.log_retention_days
  node_groups = {
    cpu      = var.cpu_node_group
    fleet    = var.fleet_node_group
    training = var.training_node_group
  }
  tags = local.tags
}

module "storage" {
  source = "./modules/storage"

  name_prefix                        = var.name_prefix
  logs_transition_days               = var.logs_transition_days
  logs_expiration_days               = var.logs_expiration_days
  noncurrent_version_expiration_days = var.noncurrent_version_expiration_days
  force_destroy                      = var.force_destroy_buckets
  tags                               = local.tags
}

module "database" {
  source = "./modules/database"

  name_prefix              = var.name_prefix
  databases                = ["prefect", "mlflow"]
  vpc_id                   = module.network.vpc_id
  subnet_ids               = module.network.private_subnet_ids
  client_security_group_id = module.cluster.node_security_group_id
  engine_version           = var.postgres_version
  instance_class           = var.database_instance_class
  allocated_storage_gib    = 20
  multi_az                 = var.database_multi_az
  deletion_protection      = var.database_deletion_protection
  backup_retention_days    = var.database_backup_retention_days
  tags                     = local.tags
}

module "irsa" {
  source = "./modules/irsa"

  name_prefix       = var.name_prefix
  oidc_provider_arn = module.cluster.oidc_provider_arn
  namespace         = var.namespace
  bucket_arns       = module.storage.bucket_arns
  kms_key_arn       = module.storage.kms_key_arn
  tags              = local.tags
}

module "platform" {
  source = "./modules/platform"

  namespace            = var.namespace
  monitoring_namespace = "monitoring"
  region               = var.region
  bucket_names         = module.storage.bucket_names
  role_arns            = module.irsa.role_arns
  databases            = module.database.endpoints
  database_credentials = module.database.credentials
  models               = var.models
  tidal_image          = var.tidal_image
  vllm_image           = var.vllm_image
  tidal_settings       = var.tidal_settings
  gateway = {
    min_replicas    = var.gateway_min_replicas
    max_replicas    = var.gateway_max_replicas
    allowed_cidrs   = var.gateway_allowed_cidrs
    certificate_arn = var.gateway_certificate_arn
    storage         = var.gateway_storage
  }
  gateway_clients      = var.gateway_clients
  prometheus_retention = var.prometheus_retention
  helm_timeout_s       = var.helm_timeout_s

  # Node groups must exist before pods can be scheduled (Helm waits for readiness).
  depends_on = [module.cluster]
}
