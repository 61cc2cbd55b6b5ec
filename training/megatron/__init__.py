"""The Megatron-core backend of the PPO trainer (train.ppo.backend = "megatron"): tensor-parallel shards of
the policy built from its HF checkpoint, trained with the same PPO loss, gathered back into an HF candidate."""
