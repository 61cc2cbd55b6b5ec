"""Settings of a PPO run on single-sample online data (one served completion per prompt).

Every setting is documented where it is declared. ``PPOConfig.validate()`` checks the
combinations (and runs on construction too); its messages say how to fix a bad value.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # peft is imported only by callers that build an adapter
    from peft import LoraConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PPOConfig(BaseModel):
    """Settings of one PPO training run (policy + value head)."""

    model_config = ConfigDict(extra="forbid")  # a typo in a setting must not pass silently

    # --- optimisation -------------------------------------------------------------------------
    learning_rate: float = Field(
        1e-4,
        description="Adam learning rate of the policy parameters (LoRA adapters or all weights). "
        "The REINFORCE pilot collapsed within 20 iterations at 3e-4.",
    )
    critic_learning_rate: float = Field(1e-4, description="Adam learning rate of the value head.")
    final_norm_learning_rate: float | None = Field(
        None,
        description="Full-weight runs: Adam learning rate of the final norm's weights, the per-dimension scale of "
        "what the LM head reads, i.e. the policy's temperature (docs/learning.md: version 1 sampled sharper earns "
        "more accepted characters, and at learning_rate the scale moves ~1e-4 a step). None: learning_rate.",
    )
    max_grad_norm: float = Field(1.0, description="Clip the global gradient norm to this before each step.")
    seed: int = Field(0, description="Seeds minibatch shuffling (and adapter init), so runs are repeatable.")

    # --- what is trained ----------------------------------------------------------------------
    lora: bool = Field(
        True,
        description="Train a LoRA adapter on a frozen base (True) or fine-tune every weight (False). "
        "Adapters are what the `lora` update strategy serves.",
    )
    lora_rank: int = Field(8, description="LoRA rank r. Serving loads adapters up to its --max-lora-rank (8 by default).")
    lora_alpha: int = Field(16, description="LoRA scale numerator: the update is (alpha / r) * B @ A.")
    lora_targets: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        description="Module names that get adapters (Qwen2 attention and MLP projections).",
    )

    # --- where the forward/backward runs ------------------------------------------------------
    backend: Literal["hf", "megatron"] = Field(
        "hf",
        description="'hf': the Hugging Face model in one process per data-parallel rank. 'megatron': the policy "
        "converted into Megatron-core shards (training/megatron/), tensor parallel over tensor_parallel processes; "
        "same PPO loss, candidate gathered back to an HF checkpoint. Needs lora=False.",
    )
    tensor_parallel: int = Field(
        1,
        description="Megatron backend: processes each layer is split over (torchrun --nproc-per-node must be a "
        "multiple; the rest is data parallel). Must divide the key/value heads and the MLP width.",
    )
    pipeline_parallel: int = Field(
        1,
        description="Megatron backend: pipeline stages. Weight conversion supports any divisor of the layer "
        "count; the PPO step runs one stage (1) for now.",
    )

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where a single trainer process computes: 'auto' its GPU when CUDA is available, else the CPU; "
        "'cuda' refuses to start without one; 'cpu' stays on the CPU. Under torchrun each process takes the GPU of "
        "its LOCAL_RANK (NCCL) whenever CUDA is available.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="'bf16': the forward and backward passes run under bfloat16 autocast (matmuls in bf16, half the "
        "activation memory); the weights, their gradients and Adam's state stay float32 (the master weights), and "
        "log-probs, values and losses are computed in float32. 'fp32': everything float32. Backend 'hf' only.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them: "
        "activation memory of about one layer instead of all, for ~1/3 more compute. Backend 'hf' only.",
    )
    micro_batch_tokens: int | None = Field(
        None,
        description="Largest rows x padded length one forward/backward takes: a minibatch with more is split into "
        "micro-batches whose gradients add up to the whole minibatch's (the same step up to float rounding), so a "
        "minibatch of long rows fits a GPU whatever its size (a row longer than it runs alone). Size it to the GPU's "
        "memory (activations grow with it); None: one forward per minibatch.",
    )

    # --- batch and epochs ---------------------------------------------------------------------
    batch_size: int = Field(64, description="Samples (prompt + one completion) per PPO iteration.")
    minibatch_size: int = Field(16, description="Samples per optimizer step; must divide batch_size.")
    epochs: int = Field(2, description="Passes over each batch (each pass reshuffles the minibatches).")
    passes: int = Field(
        4,
        description="Passes over the training rows of the dataset; each pass reshuffles them into batches "
        "of batch_size (one PPO iteration per batch).",
    )
    max_iterations: int | None = Field(
        None, description="Stop after this many PPO iterations even if passes are left. None runs every pass."
    )
    target_kl: float | None = Field(
        0.05,
        description="Stop the remaining minibatches of an epoch (and later epochs) once the approximate "
        "KL(pi_old || pi_new) exceeds 1.5 * target_kl. None never stops early.",
    )

    # --- PPO surrogate and critic --------------------------------------------------------------
    clip_eps: float = Field(0.2, description="Policy ratio clip: the surrogate uses clip(r, 1 - eps, 1 + eps).")
    value_clip_eps: float | None = Field(
        0.2,
        description="Value clip: v_old + clip(v - v_old, -eps, eps) enters the max of the value loss. "
        "None trains the critic on the plain squared error.",
    )
    vf_coef: float = Field(0.5, description="Weight of the value loss in the total loss.")
    entropy_coef: float = Field(0.0, description="Weight of the entropy bonus (subtracted from the loss).")

    # --- rewards and advantages ----------------------------------------------------------------
    gamma: float = Field(1.0, description="Discount per completion token (1: the terminal reward counts fully).")
    gae_lambda: float = Field(0.95, description="GAE lambda: 0 is one-step TD, 1 is Monte-Carlo minus value.")
    kl_coef: float = Field(
        0.05,
        description="Per-token penalty -kl_coef * (log pi_old - log pi_ref) added to the reward, pulling the "
        "policy towards the reference (the champion the run started from).",
    )
    whiten_advantages: bool = Field(True, description="Normalise advantages to mean 0, std 1 over the real tokens of each batch.")

    # --- off-policy correction ------------------------------------------------------------------
    is_truncation: float = Field(
        2.0,
        description="C in the truncated importance weight min(pi_old / mu, C), mu being the served "
        "(behaviour) probability; corrects train/serve mismatch and stale versions.",
    )
    is_level: Literal["token", "sequence"] = Field(
        "token",
        description="'token': one weight per token; 'sequence': exp of the summed log-ratio of the whole "
        "completion, truncated at C and shared by its tokens.",
    )
    max_stale_versions: int | None = Field(
        2,
        description="Drop (and count) samples whose behaviour version is more than this many versions "
        "older than the policy being trained, or newer than it. None keeps every version.",
    )

    # --- hindsight rows (training/hindsight.py) --------------------------------------------------
    hindsight_partials: bool = Field(
        False,
        description="Add one row per `partial` verdict: the characters the user kept, ended with `hindsight_stop`, "
        "rewarded as an accepted suggestion of that text (behaviour = pi_old, IS weight 1). Teaches where to stop, "
        "which on-policy logs rarely show. Only training rows get one; the held-out rows stay as served.",
    )
    hindsight_stop: str = Field(
        "\n", description="Text that ends a suggestion (the clients' stop string); one token of the policy's tokenizer."
    )
    partial_credit: Literal["last_token", "kept_prefix"] = Field(
        "last_token",
        description="Where a `partial` verdict's reward goes. 'last_token': on the suggestion's last token, like every "
        "other row. 'kept_prefix': the accept reward of the kept characters on the last token kept, the rest (what "
        "going on cost) on the first token not kept, nothing after it (training/partial_credit.py).",
    )

    # --- the stop decision, credited from the verdict (training/stop_credit.py) -------------------
    stop_credit_coef: float = Field(
        0.0,
        description="Weight of the stop-versus-go-on gradient at every position where the user's verdict tells what "
        "stopping would have earned (abstaining always; every cut of a rejected suggestion; a partial's cuts at and "
        "past the kept characters). Teaches where to stop and when to show nothing, from every row rather than from "
        "the rare sampled early stop. 0 turns it off. The stop string is `hindsight_stop`.",
    )
    stop_credit_abstain: bool = Field(
        True,
        description="Credit abstaining (stopping before the first token) too. With a weak policy most verdicts are "
        "rejections, whose exact lesson is 'show nothing here', and the policy learns silence; False credits only "
        "where a shown suggestion ends (a partial's kept characters), never whether to show.",
    )

    abstain_credit: Literal["probability", "log"] = Field(
        "probability",
        description="How stop credit weighs the abstain decision (stopping before the first token). 'probability': "
        "pi(abstain) * (R_empty - R), the exact all-action gradient, whose push fades with pi(abstain) itself (a "
        "policy that shows something 97% of the time hardly moves). 'log': (R_empty - R) * log pi(abstain), the same "
        "direction divided by pi(abstain): every row's verdict moves a rare abstain as hard as a sampled token's "
        "policy-gradient term does; the abstain_budget then decides how often. The other positions keep the exact term.",
    )
    abstain_vs_best_cut: bool = Field(
        False,
        description="Weigh abstaining against the best the verdict says showing could have earned (a partial's cut at "
        "its kept characters earns the accept reward) instead of the row's own reward. Stop credit teaches stopping "
        "at those cuts, so that is what showing is worth here; rows users kept then argue against silence 2-3 times "
        "as hard. Measured, it did not teach *where* to abstain (docs/learning.md, item 34).",
    )
    stop_anchor_coef: float = Field(
        0.0,
        description="Weight of a binary KL, per completion token after the first, from the champion's probability of "
        "stopping to the policy's (training/stop_credit.py). Abstain credit pushes the stop tokens' logits, which also "
        "end suggestions early, where rejections say nothing; this holds the stop decision after the first token "
        "at the champion's except where the verdict's credit moves it. 0 turns it off.",
    )
    abstain_budget: float = Field(
        1.0,
        description="With stop_credit_abstain: the largest share of a minibatch's requests the policy may abstain on "
        "(its mean probability of showing nothing). Above it a penalty larger than any credit the rule can give "
        "pulls every row back (training/stop_credit.py), so within the budget the policy learns *where* silence "
        "pays (where verdicts were rejections, not where users kept text) instead of answering nothing. 1 = no cap.",
    )

    # --- the tokens users kept, credited from the verdict (training/kept_credit.py) ---------------
    kept_credit_coef: float = Field(
        0.0,
        description="Weight of the expected number of right tokens, sum_j pi(C_j | s_j), at every position inside "
        "the characters a user kept (partial and accepted verdicts), where C_j is every token showing the next kept "
        "characters. Sharpens the policy where users keep its text (the optimum of expected accuracy is the right "
        "token, not the calibrated distribution of the log-likelihood). 0 turns it off.",
    )

    # --- language modelling on the training code (PPO-ptx, training/ptx.py) ------------------------
    ptx_coef: float = Field(
        0.0,
        description="Weight of a next-token loss on windows of the corpus's training code, added to every PPO step "
        "(InstructGPT's PPO-ptx). Keeps the policy a code model while RL moves its suggestions; the offline gate's "
        "bits/byte check is what it protects. 0 turns it off.",
    )
    ptx_given_continues: bool = Field(
        False,
        description="Score the code loss given that the line continues (every token holding `hindsight_stop` masked "
        "out of the predictions and the targets, like the gate's bpb_stop), so it keeps the code model without "
        "pulling on the probability of stopping or abstaining, which stop credit teaches.",
    )
    sharpen_coef: float = Field(
        0.0,
        description="Weight of an entropy penalty on what to write: the mean entropy of the next-token distributions "
        "given that the line continues (tokens holding `hindsight_stop` removed) at the completion tokens "
        "(training/sharpen.py). Sharpens the policy towards its own best guesses; the stop decision is left to "
        "the stop credit. 0 turns it off.",
    )
    sharpen_temperature: float | None = Field(
        None,
        description="None: sharpen_coef weighs an entropy penalty. A temperature in (0, 1): it weighs the "
        "cross-entropy from the reference policy at that temperature (its logits divided by it) to the policy, "
        "both given that the line continues: a fixed, sharper target (LoRA runs: the reference is the model with "
        "its adapter off; full-weight runs keep a frozen copy of the starting policy).",
    )
    ptx_batch: int = Field(4, description="Code windows per PPO step (split over the processes of a data-parallel run).")
    ptx_seq_len: int = Field(128, description="Tokens per code window.")
    ptx_corpus_bytes: int = Field(
        2_000_000, description="Bytes of training code tokenized for the windows (the first files of the training split)."
    )

    @model_validator(mode="after")
    def _check(self) -> PPOConfig:
        return self.validate()

    def validate(self) -> PPOConfig:  # type: ignore[override]  # pydantic v1's deprecated classmethod
        """Raise ValueError listing every bad setting (and how to fix it); return self when all are fine.

        Runs on construction; call it again after ``model_copy(update=...)``, which skips validation.
        """
        problems: list[str] = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        for name in ("learning_rate", "critic_learning_rate", "max_grad_norm"):
            value = getattr(self, name)
            need(math.isfinite(value) and value > 0, f"{name}={value}: must be a finite number > 0")
        need(self.batch_size >= 1, f"batch_size={self.batch_size}: must be >= 1")
        need(self.minibatch_size >= 1, f"minibatch_size={self.minibatch_size}: must be >= 1")
        if self.batch_size >= 1 and self.minibatch_size >= 1:
            need(
                self.minibatch_size <= self.batch_size,
                f"minibatch_size={self.minibatch_size} > batch_size={self.batch_size}: lower minibatch_size or raise batch_size",
            )
            need(
                self.batch_size % self.minibatch_size == 0,
                f"batch_size={self.batch_size} is not a multiple of minibatch_size={self.minibatch_size}: "
                "pick a minibatch_size that divides it, e.g. "
                f"{max(d for d in range(1, self.minibatch_size + 1) if self.batch_size % d == 0)}",
            )
        need(self.epochs >= 1, f"epochs={self.epochs}: must be >= 1")
        need(self.passes >= 1, f"passes={self.passes}: must be >= 1")
        need(
            self.max_iterations is None or self.max_iterations >= 1,
            f"max_iterations={self.max_iterations}: must be >= 1, or None to run every pass",
        )
        need(
            self.target_kl is None or self.target_kl > 0,
            f"target_kl={self.target_kl}: must be > 0, or None to disable early stopping",
        )
        need(0 < self.clip_eps < 1, f"clip_eps={self.clip_eps}: must lie in (0, 1); 0.1-0.3 is usual")
        need(
            self.value_clip_eps is None or self.value_clip_eps > 0,
            f"value_clip_eps={self.value_clip_eps}: must be > 0, or None to disable value clipping",
        )
        need(self.vf_coef > 0, f"vf_coef={self.vf_coef}: must be > 0, or the critic never learns")
        need(self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef}: must be >= 0 (it is a bonus)")
        need(0 < self.gamma <= 1, f"gamma={self.gamma}: must lie in (0, 1]")
        need(0 <= self.gae_lambda <= 1, f"gae_lambda={self.gae_lambda}: must lie in [0, 1]")
        need(self.kl_coef >= 0, f"kl_coef={self.kl_coef}: must be >= 0 (0 disables the KL penalty)")
        need(
            math.isfinite(self.is_truncation) and self.is_truncation >= 1,
            f"is_truncation={self.is_truncation}: must be a finite C >= 1, so on-policy tokens "
            "(weight 1) are not down-weighted; 2 is usual",
        )
        need(
            self.max_stale_versions is None or self.max_stale_versions >= 0,
            f"max_stale_versions={self.max_stale_versions}: must be >= 0, or None to keep all versions",
        )
        need(
            not self.hindsight_partials or bool(self.hindsight_stop),
            "hindsight_partials=True needs hindsight_stop: the text that ends a suggestion (e.g. a line break)",
        )
        need(
            math.isfinite(self.stop_credit_coef) and self.stop_credit_coef >= 0,
            f"stop_credit_coef={self.stop_credit_coef}: must be a finite number >= 0 (0 turns stop credit off)",
        )
        need(
            not self.stop_credit_coef or bool(self.hindsight_stop),
            "stop_credit_coef > 0 needs hindsight_stop: the text that ends a suggestion (e.g. a line break)",
        )
        need(
            0.0 < self.abstain_budget <= 1.0,
            f"abstain_budget={self.abstain_budget}: must be in (0, 1] (a share of requests; 1 = no cap)",
        )
        need(
            self.abstain_budget == 1.0 or (self.stop_credit_coef > 0 and self.stop_credit_abstain),
            f"abstain_budget={self.abstain_budget} caps what stop credit teaches about abstaining: it needs "
            "stop_credit_coef > 0 and stop_credit_abstain=true (or set abstain_budget=1)",
        )
        need(
            self.abstain_credit == "probability"
            or (self.stop_credit_coef > 0 and self.stop_credit_abstain and self.abstain_budget < 1.0),
            "abstain_credit='log' weighs the abstain decision of stop credit, and without a cap it teaches silence "
            "(most verdicts of a weak policy are rejections): it needs stop_credit_coef > 0, stop_credit_abstain=true "
            "and abstain_budget < 1 (or set abstain_credit='probability')",
        )
        need(
            math.isfinite(self.stop_anchor_coef) and self.stop_anchor_coef >= 0,
            f"stop_anchor_coef={self.stop_anchor_coef}: must be a finite number >= 0 (0 turns the anchor off)",
        )
        need(
            not self.stop_anchor_coef or self.stop_credit_coef > 0,
            f"stop_anchor_coef={self.stop_anchor_coef} holds what stop credit moves: it needs stop_credit_coef > 0",
        )
        need(
            math.isfinite(self.kept_credit_coef) and self.kept_credit_coef >= 0,
            f"kept_credit_coef={self.kept_credit_coef}: must be a finite number >= 0 (0 turns kept credit off)",
        )
        need(
            not self.kept_credit_coef or self.backend == "hf",
            "kept_credit_coef > 0 is implemented for "
            "backend='hf' only (it reads the whole vocabulary's probabilities): set kept_credit_coef=0 with "
            "backend='megatron'",
        )
        need(
            math.isfinite(self.sharpen_coef) and self.sharpen_coef >= 0,
            f"sharpen_coef={self.sharpen_coef}: must be a finite number >= 0 (0 turns sharpening off)",
        )
        need(
            not self.sharpen_coef or bool(self.hindsight_stop),
            "sharpen_coef > 0 sharpens given that the line continues: it needs hindsight_stop (the stop string)",
        )
        need(
            self.final_norm_learning_rate is None
            or (self.final_norm_learning_rate > 0 and not self.lora and self.backend == "hf"),
            f"final_norm_learning_rate={self.final_norm_learning_rate}: must be > 0, and needs lora=false and "
            "backend='hf' (an adapter run never trains the final norm); or leave it unset",
        )
        need(
            self.sharpen_temperature is None or 0 < self.sharpen_temperature < 1,
            f"sharpen_temperature={self.sharpen_temperature}: must lie in (0, 1) (a sharper target), or None for "
            "the entropy penalty",
        )
        need(
            not self.sharpen_coef or self.backend == "hf",
            "sharpen_coef > 0 is implemented for backend='hf' only "
            "(it reads the whole vocabulary's probabilities): set sharpen_coef=0 with backend='megatron'",
        )
        need(
            math.isfinite(self.ptx_coef) and self.ptx_coef >= 0,
            f"ptx_coef={self.ptx_coef}: must be a finite number >= 0 (0 turns the code loss off)",
        )
        need(
            not self.ptx_given_continues or (self.ptx_coef > 0 and bool(self.hindsight_stop)),
            "ptx_given_continues=true shapes the code loss: it needs ptx_coef > 0 and hindsight_stop (the stop string)",
        )
        if self.ptx_coef > 0:
            need(self.ptx_batch >= 1, f"ptx_batch={self.ptx_batch}: must be >= 1 with ptx_coef > 0")
            need(self.ptx_seq_len >= 2, f"ptx_seq_len={self.ptx_seq_len}: must be >= 2 with ptx_coef > 0")
            need(
                self.ptx_corpus_bytes >= 10_000,
                f"ptx_corpus_bytes={self.ptx_corpus_bytes}: must be >= 10000, enough code for distinct windows",
            )
            need(
                self.backend == "hf", "ptx_coef > 0 is implemented for backend='hf' only: set ptx_coef=0 with backend='megatron'"
            )
        need(
            not self.stop_credit_coef or self.backend == "hf",
            "stop_credit_coef > 0 is implemented for "
            "backend='hf' only (it reads the whole vocabulary's stop probability): set stop_credit_coef=0 with "
            "backend='megatron'",
        )
        need(
            self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
            f"micro_batch_tokens={self.micro_batch_tokens}: must be >= 1 (rows x padded length), or None for one "
            "forward per minibatch",
        )
        need(
            self.backend == "hf" or (self.precision == "fp32" and not self.gradient_checkpointing),
            f"precision={self.precision!r}, gradient_checkpointing={self.gradient_checkpointing} are implemented for "
            "backend='hf' only (Megatron-core has its own bf16 and recompute settings): set precision='fp32' and "
            "gradient_checkpointing=false with backend='megatron'",
        )
        if self.lora:
            need(self.lora_rank >= 1, f"lora_rank={self.lora_rank}: must be >= 1")
            need(self.lora_alpha > 0, f"lora_alpha={self.lora_alpha}: must be > 0")
            need(bool(self.lora_targets), "lora_targets is empty: name modules to adapt, or set lora=False")
        if self.backend == "megatron":
            need(
                not self.lora,
                "backend='megatron' trains every weight: set lora=False and serve the model with a "
                "full-weight update strategy (restart, reload or nccl)",
            )
            need(self.tensor_parallel >= 1, f"tensor_parallel={self.tensor_parallel}: must be >= 1")
            need(
                self.pipeline_parallel == 1,
                f"pipeline_parallel={self.pipeline_parallel}: the Megatron PPO step runs "
                "one pipeline stage; use tensor_parallel to split a larger policy",
            )
        else:
            need(
                self.tensor_parallel == 1 and self.pipeline_parallel == 1,
                f"tensor_parallel={self.tensor_parallel}, pipeline_parallel={self.pipeline_parallel}: model "
                "parallelism needs backend='megatron'",
            )
        if problems:
            raise ValueError("invalid PPOConfig:\n  - " + "\n  - ".join(problems))
        return self

    @property
    def tab_aids(self) -> bool:
        """Whether these settings ask for an aid that values partial suggestions by the Tab rule (hindsight rows,
        split credit, stop credit): a dataset under another rule cannot be trained with them."""
        return self.hindsight_partials or self.partial_credit != "last_token" or self.stop_credit_coef > 0

    def lora_config(self, init_lora_weights: bool = True) -> LoraConfig:
        """The PEFT adapter these settings describe (B = 0 at init, so training starts at the base)."""
        from peft import LoraConfig  # only adapter users pay for the import

        if not self.lora:
            raise ValueError("lora=False: this run fine-tunes all weights and has no adapter config")
        return LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            target_modules=list(self.lora_targets),
            lora_dropout=0.0,  # dropout would make pi_old != pi_theta at the first step
            init_lora_weights=init_lora_weights,
            task_type="CAUSAL_LM",
        )
