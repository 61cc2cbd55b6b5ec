resource "kubernetes_namespace_v1" "tidal" {
  metadata {
    name = var.namespace
    labels = {
      # Pod Security Admission: Tidal's pods run non-root without privileges.
      "pod-security.kubernetes.io/enforce" = "baseline"
      "pod-security.kubernetes.io/warn"    = "restricted"
    }
  }
}

resource "kubernetes_namespace_v1" "monitoring" {
  metadata {
    name = var.monitoring_namespace
  }
}
