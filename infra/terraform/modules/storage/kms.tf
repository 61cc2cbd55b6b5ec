data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

# One customer-managed key for all four buckets: IRSA policies name it, so access to data needs
# both the bucket grant and the key grant.
resource "aws_kms_key" "storage" {
  description             = "tidal-storage: SSE-KMS key of the Tidal buckets"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

resource "aws_kms_alias" "storage" {
  name          = "alias/${var.name_prefix}-storage"
  target_key_id = aws_kms_key.storage.key_id
}

# Key policy: the account administers and may delegate use through IAM policies (the IRSA roles).
# In a key policy "*" as resource means this key only.
data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109:Key policy: resource "*" is the key itself; administration is limited to this account's IAM principals.
  #checkov:skip=CKV_AWS_111:Key policy: resource "*" is the key itself; writes are limited to this account's IAM principals.
  #checkov:skip=CKV_AWS_356:Key policy: resource "*" is the key itself (key policies cannot name other resources).
  statement {
    sid    = "AccountAdministersKey"
    effect = "Allow"
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
    actions = [
      "kms:CancelKeyDeletion",
      "kms:CreateAlias",
      "kms:DeleteAlias",
      "kms:DescribeKey",
      "kms:DisableKey",
      "kms:DisableKeyRotation",
      "kms:EnableKey",
      "kms:EnableKeyRotation",
      "kms:GetKeyPolicy",
      "kms:GetKeyRotationStatus",
      "kms:ListAliases",
      "kms:ListGrants",
      "kms:ListKeyPolicies",
      "kms:ListResourceTags",
      "kms:PutKeyPolicy",
      "kms:RevokeGrant",
      "kms:RotateKeyOnDemand",
      "kms:ScheduleKeyDeletion",
      "kms:TagResource",
      "kms:UntagResource",
      "kms:UpdateAlias",
      "kms:UpdateKeyDescription",
    ]
    resources = ["*"]
  }

  statement {
    sid    = "AccountUsesKeyThroughIam"
    effect = "Allow"
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
    actions = [
      "kms:Decrypt",
      "kms:Encrypt",
      "kms:GenerateDataKey",
      "kms:ReEncryptFrom",
      "kms:ReEncryptTo",
    ]
    resources = ["*"]
  }
}
