# Who may reach Tidal's pods inside the cluster. The engines' HTTP API is unauthenticated and includes
# admin endpoints (runtime LoRA loading, collective_rpc): only the gateway (completions) and the fleet
# supervisor (health, probes, adapters; and the fetcher sidecar of the engines it creates) may call it.
# (Prometheus does not scrape the engines; to add it, allow the monitoring namespace on /metrics through a
# proxy, not on the engine's port, which serves the admin endpoints too.) The supervisor's admin API takes a token, and only
# the gateway and flow-run pods need it; Prometheus (the monitoring namespace) scrapes its /metrics on the same port.
# The trainers' Pushgateway takes pushes from trainer and flow-run pods and scrapes from Prometheus alone.
# A pod a policy selects accepts only what the policy allows.
locals {
  tidal_labels = { "app.kubernetes.io/name" = "tidal" }
  # Engine pods: the chart's static vLLM Deployments (component vllm-<model>) and the ones the fleet
  # supervisor creates (component engine).
  engine_components = concat(["engine"], [for m in var.models : "vllm-${m.name}"])
  engine_port       = 8000 # vLLM's API (vllm.port; fleet.kubernetes.port)
  weights_port      = 8001 # the supervisor's engines: the checkpoint fetcher sidecar (fleet.kubernetes.weights_port)
  supervisor_port   = 8090
  gateway_pod_port  = 8000
  pushgateway_port  = 9091 # the chart's metrics.pushgateway
  monitoring_peer   = { "kubernetes.io/metadata.name" = var.monitoring_namespace }
}

resource "kubernetes_network_policy_v1" "engines" {
  metadata {
    name      = "tidal-engines"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = local.tidal_labels
      match_expressions {
        key      = "app.kubernetes.io/component"
        operator = "In"
        values   = local.engine_components
      }
    }
    policy_types = ["Ingress"]
    ingress {
      from {
        pod_selector {
          match_labels = local.tidal_labels
          match_expressions {
            key      = "app.kubernetes.io/component"
            operator = "In"
            values   = ["gateway", "fleet-supervisor"]
          }
        }
      }
      ports {
        port     = local.engine_port
        protocol = "TCP"
      }
    }
    ingress {
      from {
        pod_selector {
          match_labels = merge(local.tidal_labels, { "app.kubernetes.io/component" = "fleet-supervisor" })
        }
      }
      ports {
        port     = local.weights_port
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "fleet_supervisor" {
  metadata {
    name      = "tidal-fleet-supervisor"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = merge(local.tidal_labels, { "app.kubernetes.io/component" = "fleet-supervisor" })
    }
    policy_types = ["Ingress"]
    ingress {
      from {
        pod_selector {
          match_labels = local.tidal_labels
          match_expressions {
            key      = "app.kubernetes.io/component"
            operator = "In"
            values   = ["gateway", "flow-run"]
          }
        }
      }
      ports {
        port     = local.supervisor_port
        protocol = "TCP"
      }
    }
    ingress {
      from {
        namespace_selector {
          match_labels = local.monitoring_peer
        }
      }
      ports {
        port     = local.supervisor_port
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "pushgateway" {
  metadata {
    name      = "tidal-pushgateway"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = merge(local.tidal_labels, { "app.kubernetes.io/component" = "pushgateway" })
    }
    policy_types = ["Ingress"]
    ingress {
      from {
        pod_selector {
          match_labels = local.tidal_labels
          match_expressions {
            key      = "app.kubernetes.io/component"
            operator = "In"
            values   = ["trainer", "flow-run"]
          }
        }
      }
      from {
        namespace_selector {
          match_labels = local.monitoring_peer
        }
      }
      ports {
        port     = local.pushgateway_port
        protocol = "TCP"
      }
    }
  }
}

# The gateway takes client traffic from its load balancer (source ranges: var.gateway.allowed_cidrs) and
# Prometheus scrapes; nothing else of it is reachable.
resource "kubernetes_network_policy_v1" "gateway" {
  metadata {
    name      = "tidal-gateway"
    namespace = kubernetes_namespace_v1.tidal.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = merge(local.tidal_labels, { "app.kubernetes.io/component" = "gateway" })
    }
    policy_types = ["Ingress"]
    ingress {
      ports {
        port     = local.gateway_pod_port
        protocol = "TCP"
      }
    }
  }
}
