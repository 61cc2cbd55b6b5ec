# Provider and module versions are pinned here; `terraform init` writes the exact builds to
# .terraform.lock.hcl, which belongs in version control of the deployment that applies this.
terraform {
  # 1.9+ lets a variable's validation refer to other variables (models vs. fleet instance types).
  required_version = ">= 1.9.0, < 2.0.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # terraform-aws-modules eks 21.x and vpc 6.x need >= 6.28.
      version = "~> 6.28"
    }
    helm = {
      source = "hashicorp/helm"
      # 3.x: the `kubernetes` and `exec` settings are attributes (= { ... }), not blocks.
      version = "~> 3.1"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 3.2"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.7"
    }
    # Used inside the EKS module; pinned here so the lock file fixes them too.
    tls = {
      source  = "hashicorp/tls"
      version = "~> 4.1"
    }
    time = {
      source  = "hashicorp/time"
      version = "~> 0.13"
    }
    cloudinit = {
      source  = "hashicorp/cloudinit"
      version = "~> 2.3"
    }
    null = {
      source  = "hashicorp/null"
      version = "~> 3.2"
    }
  }
}
