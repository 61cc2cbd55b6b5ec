"""PPO-ptx: a language-modelling loss on the training code, mixed into every PPO step.

InstructGPT (Ouyang et al. 2022, §3.5) mixes pretraining gradients into PPO so that RL on one task does not
undo what the model knew. Tidal needs the same: Tab verdicts mostly teach where a suggestion should stop, and
that lesson spreads to every position of the code model. Measured on a demo's logs (bench/offline_ppo.py, 60
iterations at kl_coef 0.05 with hindsight rows), held-out code bits/byte rose by 0.07 after 20 iterations and
0.29 after 60, past the offline gate's tolerance, while the KL penalty on completion tokens stayed small: the
penalty only sees the logged completions, not the code around them.

With `ptx_given_continues` the loss scores the code *given that the line continues*, as the gate's `bpb_stop`
does: the tokens holding the stop string are masked out of every prediction and the positions whose target is
one of them are not scored. The code model is still held in place, but the probability of a line break, which
is also the policy's probability of stopping (or, at a suggestion's first token, of abstaining), is left to
the stop credit: at coefficient 1 the plain loss held the suggestion rate at version 1's whatever the stop
credit said (docs/learning.md).

The windows come from the corpus's training split only: the offline gate scores bits/byte on the held-out files
and the simulated users draw their sites from those, so neither ever sees text this loss trained on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from data_contracts import corpus
from tidal.model_settings import CorpusSource
from training.ppo_config import PPOConfig
from training.ppo_trainer import seeded_generator
from training.pretrain import sample_batch, token_stream
from training.stop_credit import stop_token_ids

_PTX_STREAM = 0x707478  # separates these draws from the minibatch order's (seed, iteration, epoch)


def ptx_stream(
    tokenizer: PreTrainedTokenizerBase, heldout_fraction: float, max_bytes: int, source: CorpusSource | None = None
) -> torch.Tensor:
    """1-D token stream (eos-separated) of the corpus's training files, in file order, up to ~max_bytes of text.

    heldout_fraction must be the bootstrap's (settings.bootstrap.heldout_fraction): it decides which files are
    held out for the gate and the simulated users. `source` is the model's corpus (the standard library if None)."""
    split = corpus.corpus_split(source or CorpusSource(), heldout_fraction)
    if split is None:
        raise ValueError("the model has no corpus (models[].corpus.source: none): set train.ppo.ptx_coef to 0, or name one")
    train_files = split[0]
    texts, size = [], 0
    for text in corpus.read_texts(train_files):
        if size >= max_bytes:
            break
        texts.append(text[: max_bytes - size])
        size += len(texts[-1].encode())
    return token_stream(tokenizer, texts)


class PtxLoss:
    """Draws each PPO step's code windows and computes this process's part of their mean next-token loss.

    Windows are a pure function of (seed, iteration, epoch, step), like the minibatch order, so a resumed run
    draws what an uninterrupted one would. Data parallel, every process draws the same `batch` windows and takes
    windows[rank::world]; each returns its summed token loss divided by the tokens of all windows, so the summed
    gradients are those of the mean over the whole draw (and a process with no window contributes nothing)."""

    def __init__(self, data: torch.Tensor, batch: int, seq_len: int, seed: int, given_not: list[int] | None = None):
        """`given_not`: token ids (every token holding the stop string) the loss conditions away; None scores all."""
        if len(data) <= seq_len + 1:
            raise ValueError(
                f"ptx corpus of {len(data)} tokens is shorter than one window of {seq_len + 1}: raise "
                "train.ppo.ptx_corpus_bytes or lower train.ppo.ptx_seq_len"
            )
        self.data, self.batch, self.seq_len, self.seed = data, batch, seq_len, seed
        self.given_not = torch.tensor(sorted(set(given_not or [])), dtype=torch.long)  # (S,) masked out, maybe empty

    def windows(self, iteration: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq_len) inputs and next-token targets of one step, the same in every process."""
        gen = seeded_generator(self.seed, iteration, epoch, step, _PTX_STREAM)
        return sample_batch(self.data, self.batch, self.seq_len, gen)

    def loss(
        self, model: torch.nn.Module, iteration: int, epoch: int, step: int, rank: int = 0, world: int = 1
    ) -> torch.Tensor | None:
        """This process's share of the step's mean token cross-entropy (nats); None when it has no window."""
        x, y = self.windows(iteration, epoch, step)
        x, y = x[rank::world], y[rank::world]
        if not len(x):
            return None
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits, _ = model(x, torch.ones_like(x))  # (b, L, V); the value head's output is not used
        logits, y = logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)  # (b*L, V), (b*L,)
        if len(self.given_not):  # the code given that the line continues: stop tokens out of the softmax and targets
            stops = self.given_not.to(device)
            logits = logits.index_fill(1, stops, float("-inf"))
            y = torch.where(torch.isin(y, stops), torch.full_like(y, -100), y)  # -100: not scored
        total = F.cross_entropy(logits, y, reduction="sum", ignore_index=-100)
        return total / (self.batch * self.seq_len)


def ptx_loss_for(
    cfg: PPOConfig, tokenizer: PreTrainedTokenizerBase, heldout_fraction: float, source: CorpusSource | None = None
) -> PtxLoss | None:
    """The run's code loss over the corpus's training split as `cfg` describes it; None when ptx_coef is 0."""
    if cfg.ptx_coef <= 0:
        return None
    stops = stop_token_ids(tokenizer, cfg.hindsight_stop) if cfg.ptx_given_continues else None
    return PtxLoss(
        ptx_stream(tokenizer, heldout_fraction, cfg.ptx_corpus_bytes, source), cfg.ptx_batch, cfg.ptx_seq_len, cfg.seed, stops
    )
