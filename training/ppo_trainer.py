"""PPO on logged completions, one sample per prompt: the whole algorithm, top to bottom.

Per iteration (one batch of logged samples):

    rollout   pi_old log-probs and values V_old of the logged tokens (no grad), reference log-probs
              (the champion, computed once per sample before training)
    weights   w = min(pi_old / mu, C): mu is what the *served* weights gave each token (from the log)
    rewards   the dataset's reward on the last token (a partial's split along it: training/partial_credit.py),
              -kl_coef * w * (log pi_old - log pi_ref) on every token
    GAE       advantages and returns over completion tokens, advantages whitened per batch
    update    `epochs` passes of shuffled minibatches: w-weighted clipped surrogate + clipped value loss
              - entropy bonus (+ ptx_coef * next-token loss on code windows, training/ptx.py), gradient
              clipping, early stop when approx KL > 1.5 * target_kl

Determinism: batches and minibatches come from generators seeded by (seed, pass) and
(seed, iteration, epoch), never from a running RNG, so a run resumed at iteration k replays
exactly what an uninterrupted run would do from k (given the restored weights and optimizer).

Data parallel (under torchrun, training/distributed.py): every process computes the same plan and the same
minibatch order, and handles its shard rows[rank::world] of each batch. Rollouts are per row, so a shard's are
exactly its rows' part of the batch's; advantages are whitened with the mean and variance of the whole batch;
in each global minibatch a process takes its own rows (possibly none), scales its loss by its share of the
minibatch's real tokens (the loss terms are means over all of them), and the summed gradients are the
single-process gradient of the whole minibatch. Clipping, the optimizer step and the early-stop test then run
on identical numbers in every process, which keeps the weights identical; metrics are the whole batch's. The
result equals one process's over the same plan up to float rounding (padding widths and summation order), but
for the abstain budget's penalty, which each process applies to its own rows' share.

Memory (train.ppo): a process's rows of a minibatch run forward and backward in micro-batches of at most
`micro_batch_tokens` rows x padded length, each term scaled as a process's share is, so the accumulated gradient is
the whole rows' (the abstain budget's share is measured over all of them first, in a pass without gradient);
`gradient_checkpointing` recomputes the layers in the backward; `precision` 'bf16' runs the forward under autocast
with float32 master weights (training/value_head.py).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from data_contracts.samples import RewardSample
from training import distributed
from training.ppo_config import PPOConfig
from training.ppo_loss import (
    gae,
    kl_penalized_rewards,
    masked_whiten,
    ppo_losses,
    token_entropy,
    token_logprobs,
    truncated_is_weight,
)
from training.rollout import RolloutBatch, collate
from training.value_head import PolicyWithValue

if TYPE_CHECKING:
    from training.kept_credit import KeptCredit
    from training.ptx import PtxLoss
    from training.sharpen import Sharpen
    from training.stop_credit import StopCredit


# LossParts fields summed over processes and averaged over steps into the iteration's ppo/ metrics.
_STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "is_weight_mean", "is_truncated_frac")


class TrainingDiverged(RuntimeError):
    """A loss, gradient or weight became non-finite; the message names the iteration and the fix."""


def iteration_plan(n: int, cfg: PPOConfig) -> list[list[int]]:
    """Row indices of every PPO iteration: each pass shuffles the n rows into batches of
    min(batch_size, n); rows left over after the last full batch wait for the next pass's shuffle."""
    if n < 1:
        raise ValueError("no training rows")
    size, batches = min(cfg.batch_size, n), []
    for p in range(cfg.passes):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + p)).tolist()
        batches += [perm[i : i + size] for i in range(0, n - size + 1, size)]
    return batches[: cfg.max_iterations] if cfg.max_iterations else batches


def seeded_generator(*parts: int) -> torch.Generator:
    """A generator seeded by a pure function of `parts` (the same in every process and every run)."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + p) % (2**63)
    return torch.Generator().manual_seed(seed)


def minibatch_order(n: int, cfg: PPOConfig, iteration: int, epoch: int) -> tuple[torch.Tensor, ...]:
    """Positions 0..n-1 of an iteration's batch, shuffled for (seed, iteration, epoch) and cut into minibatches
    of minibatch_size: the same in every process of a data-parallel run."""
    return torch.randperm(n, generator=seeded_generator(cfg.seed, iteration, epoch)).split(cfg.minibatch_size)


@dataclass
class Rollout:
    """A batch with everything the update needs, all (B, T) over completion tokens unless noted."""

    batch: RolloutBatch  # this process's rows of the batch (all of them for one process)
    lengths: torch.Tensor  # (B_all,) completion tokens of every row of the whole batch, in plan order
    logp_old: torch.Tensor
    values_old: torch.Tensor
    logp_ref: torch.Tensor
    is_weight: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    stop_adv: torch.Tensor | None = None  # (B, T) R_stop - R before each token (training/stop_credit.py), or None
    stop_known: torch.Tensor | None = None  # (B, T) 1 where the verdict tells R_stop
    kept: torch.Tensor | None = None  # (N, 3) (row, position, right token) where the user kept the text, or None


class PPOTrainer:
    """Owns the policy+value model, its optimizer and the reference log-probs of the training rows.

    The model may sit on a GPU (each process of a data-parallel run on its own); batches follow it there, while
    the reference log-probs and the state_dict stay on the CPU."""

    def __init__(
        self,
        model: PolicyWithValue,
        cfg: PPOConfig,
        pad_token_id: int,
        dp: distributed.DataParallel | None = None,
        ptx: PtxLoss | None = None,
        stop: StopCredit | None = None,
        kept: KeptCredit | None = None,
        sharpen: Sharpen | None = None,
    ):
        if (cfg.ptx_coef > 0) != (ptx is not None):
            raise ValueError(
                f"ptx_coef={cfg.ptx_coef} needs a PtxLoss over the training code (training/ptx.py), and "
                "a PtxLoss needs ptx_coef > 0: pass both or neither"
            )
        if (cfg.stop_credit_coef > 0) != (stop is not None):
            raise ValueError(
                f"stop_credit_coef={cfg.stop_credit_coef} needs a StopCredit (training/stop_credit.py), "
                "and a StopCredit needs stop_credit_coef > 0: pass both or neither"
            )
        if (cfg.kept_credit_coef > 0) != (kept is not None):
            raise ValueError(
                f"kept_credit_coef={cfg.kept_credit_coef} needs a KeptCredit (training/kept_credit.py), "
                "and a KeptCredit needs kept_credit_coef > 0: pass both or neither"
            )
        if (cfg.sharpen_coef > 0) != (sharpen is not None):
            raise ValueError(
                f"sharpen_coef={cfg.sharpen_coef} needs a Sharpen (training/sharpen.py), and a Sharpen "
                "needs sharpen_coef > 0: pass both or neither"
            )
        self.model, self.cfg, self.pad_token_id, self.ptx, self.stop = model, cfg, pad_token_id, ptx, stop
        self.kept, self.sharpen = kept, sharpen
        # the frozen reference distillation sharpens from: a LoRA run's is the model with its adapter off; a
        # full-weight run keeps a copy of the policy as it starts (the champion)
        self._reference = (
            copy.deepcopy(model).requires_grad_(False).eval()
            if (cfg.sharpen_temperature is not None or cfg.stop_anchor_coef > 0) and not cfg.lora
            else None
        )
        self.dp = dp if dp is not None else distributed.data_parallel()  # the processes that split each batch
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        groups = (
            model.param_groups(cfg.learning_rate, cfg.critic_learning_rate, cfg.final_norm_learning_rate)
            if cfg.final_norm_learning_rate is not None
            else model.param_groups(cfg.learning_rate, cfg.critic_learning_rate)
        )
        self.optimizer = torch.optim.Adam(groups)
        self.ref_logprobs: dict[int, torch.Tensor] = {}  # training row -> (T_i,) log pi_ref of its tokens, on the CPU

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- the reference: the policy as it was before any update -----------------------------------
    @torch.no_grad()
    def token_logprobs(self, samples: Sequence[RewardSample], chunk: int = 64) -> list[torch.Tensor]:
        """Per sample, (T_i,) log-probs of its completion tokens under the current policy."""
        self.model.eval()
        out = []
        for i in range(0, len(samples), chunk):
            batch = collate(samples[i : i + chunk], self.pad_token_id).to(self.device)
            logits, _ = self.model(batch.input_ids, batch.attention_mask)
            logp = token_logprobs(batch.sampled_logits(logits), batch.completion_ids)  # (b, T)
            lengths = batch.mask.sum(1).long().tolist()
            out += [logp[j, :n].to("cpu", copy=True) for j, n in enumerate(lengths)]
        return out

    def compute_reference(self, samples: Sequence[RewardSample], rows: Iterable[int] | None = None) -> None:
        """Fix pi_ref: the policy as it is now, before any update (the champion the run starts from).

        Only `rows` (default: all) get a reference: a run capped by max_iterations touches a fraction of a
        large dataset, and this forward pass over every row would otherwise cost more than the training.
        Data parallel, each process computes every world-th row and all then hold all of them: a row's shard
        changes from batch to batch, and the checkpoint (state_dict) is the same in every process and the same
        as one process's, so a run resumes with any number of processes."""
        rows = sorted(set(range(len(samples)) if rows is None else rows))
        mine = rows[self.dp.rank :: self.dp.size]
        self.ref_logprobs = dict(
            sorted(
                distributed.gather_dicts(dict(zip(mine, self.token_logprobs([samples[r] for r in mine]))), self.dp.group).items()
            )
        )

    def _ref_batch(self, rows: Sequence[int], T: int) -> torch.Tensor:
        out = torch.zeros((len(rows), T))  # (B, T), 0 on padding
        for j, r in enumerate(rows):
            out[j, : len(self.ref_logprobs[r])] = self.ref_logprobs[r]
        return out.to(self.device)

    # --- one iteration ----------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, samples: Sequence[RewardSample], rows: Sequence[int]) -> Rollout:
        """Roll out this process's shard rows[rank::world] of the batch `rows` (every row for one process)."""
        cfg, world = self.cfg, self.dp.size
        if len(rows) < world:
            raise ValueError(
                f"a batch of {len(rows)} rows cannot be split over {world} processes: raise "
                f"train.ppo.batch_size to at least {world}, or start fewer processes"
            )
        self.model.eval()
        mine = list(rows)[self.dp.rank :: world]
        batch = collate([samples[r] for r in mine], self.pad_token_id).to(self.device)
        logits, values = self.model(batch.input_ids, batch.attention_mask)
        mask = batch.mask  # (B, T)
        logp_old = token_logprobs(batch.sampled_logits(logits), batch.completion_ids) * mask  # (B, T)
        values_old = batch.completion_view(values).float() * mask  # (B, T) V of each token's context
        logp_ref = self._ref_batch(mine, mask.shape[1])  # (B, T)
        # (B, T) behaviour log-probs mu from the serving engine, as logged; pi_old for rows mu did not draw (w = 1)
        mu = torch.where(batch.served[:, None], batch.behaviour_logprobs, logp_old)
        w = truncated_is_weight(logp_old, mu, mask, cfg.is_truncation, cfg.is_level)
        rewards = kl_penalized_rewards(batch.token_rewards, logp_old, logp_ref, mask, cfg.kl_coef, is_weight=w)
        advantages, returns = gae(rewards, values_old, mask, cfg.gamma, cfg.gae_lambda)
        if cfg.whiten_advantages:  # over the whole batch: every process's tokens
            advantages = masked_whiten(advantages, mask, sum_all=self._sum_all if world > 1 else None)
        lengths = torch.tensor(
            [len(samples[r].completion_token_ids) for r in rows], dtype=torch.float32, device=self.device
        )  # (B_all,) = the whole batch's mask.sum(1)
        stop_adv = stop_known = None
        if self.stop is not None:
            stop_adv, stop_known = (t.to(self.device) for t in self.stop.batch([samples[r] for r in mine], mask.shape[1]))
        kept = self.kept.batch([samples[r] for r in mine]) if self.kept is not None else None
        return Rollout(batch, lengths, logp_old, values_old, logp_ref, w, advantages, returns, stop_adv, stop_known, kept)

    def update(self, ro: Rollout, iteration: int) -> dict[str, float]:
        """`epochs` passes of minibatch PPO steps over one rollout; returns the iteration's metrics."""
        cfg, b = self.cfg, ro.batch
        world, rank = self.dp.size, self.dp.rank
        self.model.train()
        B, sums, steps, stopped = len(ro.lengths), {}, 0, False
        for epoch in range(cfg.epochs):
            for step, mb in enumerate(minibatch_order(B, cfg, iteration, epoch)):  # positions in the whole batch
                # this process's rows of the minibatch: position j is row j // world of shard j % world (maybe none)
                mine = (mb[mb % world == rank] // world).to(b.mask.device)
                self.optimizer.zero_grad(set_to_none=True)
                stats = self._minibatch_backward(ro, mine, ro.lengths[mb.to(ro.lengths.device)].sum(), len(mb))
                ptx = self.ptx.loss(self.model, iteration, epoch, step, rank, world) if self.ptx else None
                if ptx is not None:  # this process's share of the step's code windows
                    (cfg.ptx_coef * ptx).backward()
                    stats[0] += cfg.ptx_coef * ptx.detach()
                ptx = torch.zeros((), device=stats.device) if ptx is None else ptx.detach()
                stats = torch.cat([stats.detach(), ptx.view(1)])
                # (6 + len(_STATS),) the whole minibatch's loss, LossParts, stop-, kept-credit, sharpen, stop anchor and ptx
                # losses; gradients summed over processes
                stats = distributed.sum_grads(self.trainable, stats, self.dp.group)
                self._check_finite(stats[0], iteration, "loss")
                grad_norm = self._clip_grad_norm(cfg.max_grad_norm)
                self._check_finite(grad_norm, iteration, "gradient norm")
                self.optimizer.step()
                steps += 1
                for name, value in zip(
                    (*_STATS, "stop_credit_loss", "kept_credit_loss", "sharpen_loss", "stop_anchor_loss", "ptx_loss"),
                    stats[1:].tolist(),
                ):
                    sums[name] = sums.get(name, 0.0) + value
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm)
                if cfg.target_kl is not None and float(stats[1 + _STATS.index("approx_kl")]) > 1.5 * cfg.target_kl:
                    stopped = True
                    break
            if stopped:
                break
        for p in self.trainable:
            if not torch.isfinite(p).all():
                self._check_finite(torch.tensor(math.nan), iteration, "weights")
        if self.ptx is None:
            del sums["ptx_loss"]  # not computed: no metric rather than a zero
        if self.stop is None:
            del sums["stop_credit_loss"]
        if self.kept is None:
            del sums["kept_credit_loss"]
        if self.sharpen is None:
            del sums["sharpen_loss"]
        if not cfg.stop_anchor_coef:
            del sums["stop_anchor_loss"]
        metrics = {f"ppo/{k}": v / steps for k, v in sums.items()}
        m, w = b.mask, ro.is_weight
        # sums over the whole batch's real tokens, then the means masked_mean would give on one process
        kl_w, w_sum, value_sum, adv_sum, tokens, reward_sum = self._sum_all(
            torch.stack(
                [
                    (w * (ro.logp_old - ro.logp_ref) * m).sum(),
                    (w * m).sum(),
                    (ro.values_old * m).sum(),
                    (ro.advantages.abs() * m).sum(),
                    m.sum(),
                    b.rewards.sum(),
                ]
            )
        ).unbind()
        tokens = tokens.clamp_min(1.0)
        metrics.update(
            {
                "ppo/early_stopped": float(stopped),
                "ppo/epochs_done": float(epoch + 1),
                # KL(pi_old || pi_ref) per token: the tokens were sampled from mu, so weight them by w ~ pi_old / mu
                "ppo/kl_ref": float((kl_w / tokens) / (w_sum / tokens).clamp_min(1e-8)),
                "ppo/reward_mean": float(reward_sum / B),
                "ppo/value_mean": float(value_sum / tokens),
                "ppo/advantage_abs_mean": float(adv_sum / tokens),
            }
        )
        return metrics

    def _minibatch_backward(self, ro: Rollout, mine: torch.Tensor, n_tokens: torch.Tensor, n_rows: int) -> torch.Tensor:
        """Forward and backward of this process's rows `mine` (positions in its shard, maybe none) of a minibatch of
        `n_rows` rows and `n_tokens` completion tokens (every process's), in micro-batches of at most
        micro_batch_tokens rows x padded length: the gradients accumulate to the whole rows' at once. Returns the
        (5 + len(_STATS),) loss figures: the total, LossParts, stop-, kept-credit, sharpen and stop anchor losses."""
        b, cfg = ro.batch, self.cfg
        if not len(mine):
            return torch.zeros(5 + len(_STATS), device=b.mask.device)
        per = len(mine) if cfg.micro_batch_tokens is None else max(1, cfg.micro_batch_tokens // b.input_ids.shape[1])
        chunks = mine.split(per)
        whole = None  # the abstain budget's (share, rows) over all of `mine`, when it is split
        if len(chunks) > 1 and self.stop is not None and cfg.abstain_budget < 1.0:
            whole = self._abstain_share(ro, chunks)
        return sum(self._rows_backward(ro, rows, n_tokens, n_rows, whole) for rows in chunks)

    @torch.no_grad()
    def _abstain_share(self, ro: Rollout, chunks: Sequence[torch.Tensor]) -> tuple[float, float]:
        """(mean pi(abstain) at the first token, rows with one) over the rows of `chunks` under the current weights."""
        b, total, n = ro.batch, 0.0, 0.0
        for rows in chunks:
            logits, _ = self.model(b.input_ids[rows], b.attention_mask[rows])
            first = b.mask[rows][:, 0]
            total += float((self.stop.stop_prob(b.sampled_logits(logits, rows))[:, 0] * first).sum())
            n += float(first.sum())
        return total / max(n, 1.0), n

    def _rows_backward(
        self, ro: Rollout, rows: torch.Tensor, n_tokens: torch.Tensor, n_rows: int, whole: tuple[float, float] | None
    ) -> torch.Tensor:
        """Backward of the minibatch loss's part over `rows` (positions in this process's shard); its figures."""
        cfg, b = self.cfg, ro.batch
        # their share of the minibatch's real tokens: the loss terms are means over all of them, so the shares
        # times the local means add up to the whole minibatch's (exactly 1 for one process and one micro-batch)
        share = b.mask[rows].sum() / n_tokens
        logits, values = self.model(b.input_ids[rows], b.attention_mask[rows])
        logits = b.sampled_logits(logits, rows)  # (b, T, V) at each row's sampling temperature
        parts = ppo_losses(
            logp_new=token_logprobs(logits, b.completion_ids[rows]),
            logp_old=ro.logp_old[rows],
            advantages=ro.advantages[rows],
            values_new=b.completion_view(values),
            values_old=ro.values_old[rows],
            returns=ro.returns[rows],
            is_weight=ro.is_weight[rows],
            mask=b.mask[rows],
            clip_eps=cfg.clip_eps,
            value_clip_eps=cfg.value_clip_eps,
            entropy=token_entropy(logits) if cfg.entropy_coef > 0 else None,
            is_truncation=cfg.is_truncation,
        )
        loss = parts.total(cfg.vf_coef, cfg.entropy_coef)
        stop_loss = torch.zeros((), device=loss.device)
        if self.stop is not None:  # the stop-versus-go-on gradient where the verdict tells its value
            # summed over each row's positions (one decision each), averaged over the minibatch's rows (every
            # process's: the summed gradients are the whole minibatch's)
            p_stop = self.stop.stop_prob(logits)  # (b, T)
            abstain_log = cfg.abstain_credit == "log"
            stop_loss = self.stop.credit_loss(p_stop, ro.stop_adv[rows], ro.stop_known[rows], abstain_log) / n_rows
            if cfg.abstain_budget < 1.0:  # the share of this process's rows abstained on, capped
                stop_loss = stop_loss + self.stop.over_budget(p_stop, b.mask[rows][:, 0], cfg.abstain_budget, whole)
        kept_loss = torch.zeros((), device=loss.device)
        if self.kept is not None:  # minus the expected right tokens where the user kept the text, per row
            kept_loss = -self.kept.gain(logits, ro.kept, rows) / n_rows
        ref = None  # (b, T, V) the reference's logits at the rows' sampling temperature, when a loss needs them
        if cfg.sharpen_temperature is not None or cfg.stop_anchor_coef > 0:
            with torch.no_grad():
                ref = b.sampled_logits(self._reference_logits(b.input_ids[rows], b.attention_mask[rows]), rows)
        anchor_loss = torch.zeros((), device=loss.device)
        if cfg.stop_anchor_coef > 0:  # the stop decision after the first token held at the reference's
            anchor_loss = self.stop.anchor_sum(p_stop, self.stop.stop_prob(ref), b.mask[rows]) / n_tokens
        sharpen_loss = torch.zeros((), device=loss.device)
        if self.sharpen is not None:  # these rows' share of the minibatch's mean per token
            if cfg.sharpen_temperature is None:
                sharpen_sum = self.sharpen.entropy_sum(logits, b.mask[rows])
            else:
                sharpen_sum = self.sharpen.distill_sum(logits, ref, b.mask[rows], cfg.sharpen_temperature)
            sharpen_loss = sharpen_sum / n_tokens
        extra = (
            cfg.stop_credit_coef * stop_loss
            + cfg.kept_credit_coef * kept_loss
            + cfg.sharpen_coef * sharpen_loss
            + cfg.stop_anchor_coef * anchor_loss
        )
        (loss * share + extra).backward()
        stats = torch.cat(
            [
                torch.stack([loss.detach(), *(getattr(parts, k).detach() for k in _STATS)]) * share,
                torch.stack([stop_loss, kept_loss, sharpen_loss, anchor_loss]).detach(),
            ]
        )
        stats[0] += extra.detach()
        return stats

    @torch.no_grad()
    def _reference_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(b, L, V) logits of the reference policy (the champion the run started from)."""
        if self._reference is not None:
            return self._reference(input_ids, attention_mask)[0]
        with self.model.policy.disable_adapter():
            return self.model(input_ids, attention_mask)[0]

    def _sum_all(self, t: torch.Tensor) -> torch.Tensor:
        return distributed.sum_all(t, self.dp.group)

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # A model split over processes (the Megatron backend's tensor-parallel shards) knows its global norm
        clip = getattr(self.model, "clip_grad_norm", None)
        return clip(max_norm) if clip is not None else torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)

    def _check_finite(self, value: torch.Tensor, iteration: int, what: str) -> None:
        if not torch.isfinite(value).all():
            raise TrainingDiverged(
                f"PPO diverged at iteration {iteration}: the {what} is not finite (learning_rate="
                f"{self.cfg.learning_rate}, critic_learning_rate={self.cfg.critic_learning_rate}); lower "
                "train.ppo.learning_rate, and check the dataset's rewards and log-probs are finite"
            )

    # --- the loop -------------------------------------------------------------------------------------
    def train(
        self,
        samples: Sequence[RewardSample],
        plan: Sequence[Sequence[int]],
        start: int = 0,
        on_iteration: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Run iterations start..len(plan)-1; `on_iteration(i, metrics)` after each (logging, checkpoints)."""
        history = []
        for it in range(start, len(plan)):
            t0 = time.perf_counter()
            ro = self.rollout(samples, plan[it])
            metrics = self.update(ro, it)
            seconds = time.perf_counter() - t0
            # prompt and completion tokens of the whole batch (every process's rows)
            tokens = sum(len(samples[r].prompt_token_ids) + len(samples[r].completion_token_ids) for r in plan[it])
            metrics["charts/tokens_per_s"] = tokens / seconds
            metrics["charts/iteration_s"] = seconds
            history.append(metrics)
            if on_iteration is not None:
                on_iteration(it, metrics)
        return history

    # --- checkpoint state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            "trainable": {names[id(p)]: p.detach().to("cpu", copy=True) for p in self.trainable},
            "optimizer": self.optimizer.state_dict(),
            "ref_logprobs": self.ref_logprobs,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        params = dict(self.model.named_parameters())
        trainable_names = {n for n, p in params.items() if p.requires_grad}
        if set(state["trainable"]) != trainable_names:
            missing = sorted(trainable_names - set(state["trainable"]))[:3]
            extra = sorted(set(state["trainable"]) - trainable_names)[:3]
            raise ValueError(
                f"checkpoint does not match the model being trained (missing {missing}, unexpected {extra}); "
                "it belongs to another configuration: start a new run"
            )
        with torch.no_grad():
            for n, t in state["trainable"].items():
                params[n].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self.ref_logprobs = dict(state["ref_logprobs"])
        torch.set_rng_state(state["torch_rng"])
