locals {
  # GPU pools only take pods that tolerate the GPU taint, so the gateway and the platform services
  # never land on (and pin) a GPU node. The nvidia.com/gpu.present label is what the NVIDIA device
  # plugin's default node affinity selects on, without node-feature-discovery.
  gpu_taint = {
    gpu = {
      key    = "nvidia.com/gpu"
      value  = "true"
      effect = "NO_SCHEDULE"
    }
  }

  pools = {
    cpu = {
      ami_type = "AL2023_x86_64_STANDARD"
      labels   = { "tidal.dev/pool" = "cpu" }
      taints   = {}
    }
    fleet = {
      ami_type = "AL2023_x86_64_NVIDIA"
      labels   = { "tidal.dev/pool" = "fleet", "nvidia.com/gpu.present" = "true" }
      taints   = local.gpu_taint
    }
    training = {
      ami_type = "AL2023_x86_64_NVIDIA"
      labels   = { "tidal.dev/pool" = "training", "nvidia.com/gpu.present" = "true" }
      taints   = local.gpu_taint
    }
  }

  node_groups = {
    for pool, p in local.pools : pool => {
      name           = "tidal-${pool}"
      ami_type       = p.ami_type
      instance_types = var.node_groups[pool].instance_types
      min_size       = var.node_groups[pool].min_size
      max_size       = var.node_groups[pool].max_size
      desired_size   = var.node_groups[pool].desired_size
      labels         = p.labels
      taints         = p.taints

      # Encrypted root volume sized for container images and model weights (vLLM images alone are
      # ~10 GB); the module's default launch template otherwise keeps the AMI's 20 GB.
      block_device_mappings = {
        root = {
          device_name = "/dev/xvda"
          ebs = {
            volume_size           = var.node_groups[pool].disk_size_gib
            volume_type           = "gp3"
            encrypted             = true
            delete_on_termination = true
          }
        }
      }

      # IMDSv2 only, one hop: pods cannot borrow the node role; they use IRSA roles instead.
      metadata_options = {
        http_endpoint               = "enabled"
        http_tokens                 = "required"
        http_put_response_hop_limit = 1
      }

      update_config = { max_unavailable = 1 }
    }
  }
}

module "eks" {
  #checkov:skip=CKV_TF_1:Registry module pinned to an exact release version; commit hashes apply to git sources, which the Terraform Registry protocol does not use.
  source  = "terraform-aws-modules/eks/aws"
  version = "21.19.0"

  name               = var.name
  kubernetes_version = var.kubernetes_version

  vpc_id     = var.vpc_id
  subnet_ids = var.subnet_ids

  endpoint_private_access      = true
  endpoint_public_access       = true
  endpoint_public_access_cidrs = var.endpoint_public_access_cidrs

  # The identity that runs terraform installs the Helm releases, so it needs cluster admin.
  enable_cluster_creator_admin_permissions = true
  enable_irsa                              = true

  enabled_log_types                      = ["api", "audit", "authenticator", "controllerManager", "scheduler"]
  cloudwatch_log_group_retention_in_days = var.log_retention_days

  # Kubernetes secrets (database credentials, gateway keys) are envelope-encrypted with a KMS key
  # the module creates.
  encryption_config = { resources = ["secrets"] }

  addons = {
    vpc-cni = {
      before_compute = true
    }
    kube-proxy = {}
    coredns    = {}
  }

  eks_managed_node_groups = local.node_groups

  tags = var.tags
}
