"""The Megatron-core backend: HF <-> Megatron weight conversion (round trip over tensor and pipeline
parallel layouts) and real megatron-core GPTModel shards, on CPU over gloo, giving the HF model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.procs import free_port
from training.megatron.convert import ConversionError, ModelShape, hf_to_mcore, mcore_to_hf

pytest.importorskip("megatron.core")


def tiny_config(tied: bool = True, vocab: int = 101) -> Qwen2Config:
    # vocab 101 is odd on purpose: tensor parallelism pads it, and the padding must never show
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        use_sliding_window=False,
    )


def tiny_hf(tied: bool = True, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tied)).float()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_weights(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")  # the same tensor as the embedding (save_pretrained drops it too)
    return sd


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_conversion_round_trips_exactly(tied, tp, pp):
    model = tiny_hf(tied)
    shape, sd = ModelShape.of(model.config), hf_weights(model)
    shards = hf_to_mcore(sd, shape, tp, pp)
    assert len(shards) == pp and all(len(stage) == tp for stage in shards)
    back = mcore_to_hf(shards, shape)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_shards_split_heads_by_group_and_pad_the_vocabulary():
    model = tiny_hf(tied=False)
    shape = ModelShape.of(model.config)
    ((r0, r1),) = hf_to_mcore(hf_weights(model), shape, tp=2)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    # one key/value group per rank: its 2 query heads, then its k, then its v, 16 rows each
    d = shape.head_dim
    attn = "model.layers.0.self_attn."
    q, k, v = (model.state_dict()[attn + f"{n}_proj.weight"] for n in "qkv")
    assert torch.equal(r1[qkv], torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    assert r0["embedding.word_embeddings.weight"].shape == (51, 64)  # 101 -> 102 rows, half each
    assert torch.all(r1["output_layer.weight"][-1] == 0)  # the padded row
    assert r0["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)  # [gate_r; up_r], 48 rows each


def test_layouts_the_model_cannot_take_are_refused_with_the_fix():
    shape = ModelShape.of(tiny_config())
    with pytest.raises(ConversionError, match="key/value heads do not split over tensor_parallel=4"):
        shape.check(4, 1)
    with pytest.raises(ConversionError, match="4 layers do not split evenly over pipeline_parallel=3"):
        shape.check(1, 3)
    shards = hf_to_mcore(hf_weights(tiny_hf()), shape, 2, 1)
    del shards[0][1]["decoder.layers.3.mlp.linear_fc2.weight"]
    with pytest.raises(ConversionError, match="tensor ranks \\[1\\]"):
        mcore_to_hf(shards, shape)


# ---- real megatron-core shards, one process per tensor-parallel rank ------------------------------------


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as training/rollout.py collates prompts
    mask[1, :1] = 0
    mask[2, 9:] = 0  # right padding after a short completion
    return ids, mask


def _forward_matches_hf(rank: int, world: int, port: int, tied: bool, out: str) -> None:
    import torch.distributed as dist

    from training.megatron.model import MegatronPolicyWithValue, build_gpt
    from training.megatron.parallel import init_model_parallel
    from training.value_head import PolicyWithValue, ValueHead

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    init_model_parallel(tp=world)
    hf = tiny_hf(tied)
    gpt, shape = build_gpt(hf.config, tp=world)
    missing, unexpected = gpt.load_state_dict(hf_to_mcore(hf_weights(hf), shape, tp=world)[0][rank], strict=False)
    assert not unexpected and all(m.endswith("_extra_state") for m in missing), (missing, unexpected)
    head = ValueHead(64, init_std=0.1, seed=1)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        want_logits, want_values = PolicyWithValue(hf, head)(ids, mask)
        logits, values = MegatronPolicyWithValue(gpt, shape, head)(ids, mask)
    real = mask.bool()
    assert logits.shape == want_logits.shape  # the full, unpadded vocabulary on every rank
    torch.save(
        {"logits": (logits - want_logits)[real].abs().max(), "values": (values - want_values)[real].abs().max()},
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


# tp=1 (one unsharded rank) is the device script's forward below, against the same HF model
@pytest.mark.parametrize("tp,tied", [(2, True), (2, False)])
def test_megatron_shards_compute_the_hf_models_logits_and_values(tmp_path, tp, tied):
    torch.multiprocessing.spawn(_forward_matches_hf, args=(tp, free_port(), tied, str(tmp_path)), nprocs=tp)
    for rank in range(tp):
        diff = torch.load(tmp_path / f"rank{rank}.pt")
        assert diff["logits"] < 1e-5 and diff["values"] < 1e-5, (rank, diff)


# ---- the same PPO steps on both backends ------------------------------------------------------------------
def ppo_samples(n: int = 20) -> list:
    from data_contracts.samples import RewardSample

    gen, out = torch.Generator().manual_seed(5), []
    for i in range(n):
        p, t = 2 + i % 6, 1 + i % 5  # ragged prompts and completions: left and right padding in every batch
        out.append(
            RewardSample(
                request_id=f"r{i}",
                model="tab",
                version=1,
                arm="control",
                user_hash="u",
                prompt_token_ids=torch.randint(1, 101, (p,), generator=gen).tolist(),
                completion_token_ids=torch.randint(1, 101, (t,), generator=gen).tolist(),
                behaviour_logprobs=(-4.0 - torch.rand(t, generator=gen)).tolist(),
                reward=0.75 if i % 3 == 0 else -0.25,
                event="accepted" if i % 3 == 0 else "rejected",
                completion_text="x",
                accepted_chars=0,
                reward_rule="test",
                completion_time_ms=0,
                feedback_time_ms=0,
            )
        )
    return out


def ppo_cfg(**kw):
    from training.ppo_config import PPOConfig

    return PPOConfig(
        **{
            "lora": False,
            "batch_size": 10,
            "minibatch_size": 5,
            "epochs": 2,
            "passes": 1,
            "learning_rate": 1e-3,
            "critic_learning_rate": 1e-2,
            "target_kl": None,
            "seed": 0,
            "max_grad_norm": 0.5,
            **kw,
        }
    )


def _megatron_ppo(rank: int, world: int, port: int, champion: str, out: str) -> None:
    import torch.distributed as dist

    from training.megatron.parallel import data_parallel
    from training.megatron.trainable import build_megatron_trainable, gather_hf_policy
    from training.ppo_trainer import PPOTrainer, iteration_plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    c = ppo_cfg(backend="megatron", tensor_parallel=world)
    model = build_megatron_trainable(Path(champion), Path(champion), c)
    trainer, samples = PPOTrainer(model, c, 0, dp=data_parallel()), ppo_samples()
    trainer.compute_reference(samples)
    history = trainer.train(samples, iteration_plan(len(samples), c))
    hf = gather_hf_policy(model, Path(champion), Path(champion))
    if rank == 0:
        torch.save({"weights": hf.state_dict(), "head": model.value_head.state_dict(), "history": history}, f"{out}/megatron.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2])  # sharded: the global grad norm and the gathered vocabulary that tp=1 skips
def test_ppo_on_megatron_shards_takes_the_hf_backends_steps(tmp_path, tp):
    """Two PPO iterations (clipped surrogate, value loss, KL to the reference, global gradient clipping, Adam) from
    one champion: the Megatron shards, gathered back, hold the weights the HF backend reaches."""
    from training.candidate import build_trainable
    from training.ppo_trainer import PPOTrainer, iteration_plan

    champion = tmp_path / "champion"
    start = tiny_hf(tied=True)
    start.save_pretrained(champion)
    c = ppo_cfg()
    trainer, samples = PPOTrainer(build_trainable(champion, champion, c), c, 0), ppo_samples()
    trainer.compute_reference(samples)
    want_history = trainer.train(samples, iteration_plan(len(samples), c))
    want = trainer.model.policy.state_dict()

    torch.multiprocessing.spawn(_megatron_ppo, args=(tp, free_port(), str(champion), str(tmp_path)), nprocs=tp)
    got = torch.load(tmp_path / "megatron.pt")
    assert [h["ppo/grad_norm"] for h in want_history] == pytest.approx([h["ppo/grad_norm"] for h in got["history"]], rel=1e-4)
    assert want_history[-1]["ppo/policy_loss"] == pytest.approx(got["history"][-1]["ppo/policy_loss"], abs=1e-5)
    moved = max(float((want[k] - start.state_dict()[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the steps changed the weights, so the comparison below means something
    for k, v in got["weights"].items():
        assert torch.allclose(v, want[k], atol=2e-5), (k, float((v - want[k]).abs().max()))
    for k, v in got["head"].items():
        assert torch.allclose(v, trainer.model.value_head.state_dict()[k], atol=2e-5), k


def test_the_device_scripts_megatron_step_runs_and_matches_hf_on_this_machine(tmp_path):
    """bench/gpu_check.py's Megatron figures come from training/megatron/check.py; on a CPU it runs the same code."""
    import json
    import subprocess
    import sys

    tiny_hf().save_pretrained(tmp_path / "policy")
    code = "import json, sys\nfrom training.megatron.check import gpu_check_step\nprint(json.dumps(gpu_check_step(sys.argv[1])))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "policy")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["megatron_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert figures["megatron_hf_logit_max_diff"] < 1e-4
    assert figures["megatron_grad_norm"] > 0 and figures["megatron_step_s"] > 0
