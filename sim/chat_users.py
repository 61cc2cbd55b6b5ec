"""Simulated chat users with a verifiable target: each asks the chat API (the official OpenAI SDK, through the
gateway) to finish a line of held-out code whose true rest it knows, rates the answer with a thumbs and a score, and
asks once more in the same conversation when the first answer was wrong. Feedback goes to the conversation's last
turn only, so a rule's turn_discount is what credits the turn before it.

The rating (answer a: the reply's first line, a code fence and the prompt's own text stripped; target t: the true
rest of the line, `sim/tab_sites.py`):
    similarity = characters a and t share from the start / len(t)
    thumbs     up when similarity >= up_at, else down
    score      1 + 4 x similarity, on the 1-5 scale (models[].feedback.score_range [1, 5]), to 3 decimals
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import Field

from sim.tab_sites import TabSite, cursor_sites, site_files
from tidal.section import Section

ASK = "Finish this line of Python. Reply with the rest of the line only.\n```python\n{prompt}\n```"
AGAIN = "That is not it. Try again: the rest of the line only."


class ChatUsersConfig(Section):
    conversations: int = Field(20, ge=1, description="Conversations to hold (one cursor site each).")
    seed: int = Field(11, description="Seeds the cursor sites and each request's sampling seed.")
    max_turns: int = Field(2, ge=1, le=8, description="Turns a conversation may take: a wrong answer is asked again.")
    up_at: float = Field(0.5, gt=0, le=1, description="Similarity from which an answer gets a thumbs up.")
    max_tokens: int = Field(16, ge=1, description="Completion budget of each turn.")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature of each turn.")
    context_bytes: int = Field(240, ge=16, description="Code before the cursor put in the question, in UTF-8 bytes.")
    eval_fraction: float = Field(0.5, gt=0, lt=1, description="Share of held-out files kept for evaluation.")
    code_dir: Path | None = Field(None, description="A directory of Python code to draw sites from instead of the stdlib's.")


def first_line(reply: str, prompt: str) -> str:
    """The answer in a chat reply: its first non-fence line, without the prompt's last line if it was repeated."""
    lines = [ln for ln in (reply or "").splitlines() if not ln.strip().startswith("```")]
    answer = lines[0] if lines else ""
    last = prompt.rsplit("\n", 1)[-1]
    return answer[len(last) :] if last and answer.startswith(last) else answer


def rate(answer: str, intended: str, up_at: float) -> tuple[str, float, float]:
    """(thumbs, score on 1-5, similarity) of an answer to the true rest of the line."""
    k = 0
    for a, b in zip(answer, intended):
        if a != b:
            break
        k += 1
    similarity = k / len(intended) if intended else 0.0
    return ("up" if similarity >= up_at else "down"), round(1 + 4 * similarity, 3), similarity


@dataclass
class Conversation:
    """One simulated conversation: its turns' request ids (first = the conversation id) and the rating sent."""

    site: TabSite
    request_ids: list[str] = field(default_factory=list)
    thumbs: str = ""
    score: float = 0.0
    similarity: float = 0.0


@dataclass
class ChatTally:
    conversations: list[Conversation] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    arms: Counter = field(default_factory=Counter)  # turns served per arm ('control', 'canary'), from each reply

    def summary(self) -> dict:
        done = [c for c in self.conversations if c.thumbs]
        return {
            "conversations": len(done),
            "turns": sum(len(c.request_ids) for c in done),
            "thumbs_up": sum(c.thumbs == "up" for c in done),
            "mean_score": round(sum(c.score for c in done) / len(done), 3) if done else None,
            "errors": dict(self.errors),
            "arms": dict(self.arms),
        }


def hold_conversations(
    gateway_url: str,
    api_key: str,
    model: str,
    heldout_fraction: float,
    cfg: ChatUsersConfig,
    stop: threading.Event | None = None,
) -> ChatTally:
    """Hold cfg.conversations conversations one after another; each ends with a thumbs and a score on its last
    turn (POST /v1/feedback: the SDK has no feedback call). `stop`, once set, ends the run before the next
    conversation (a conversation under way is finished and rated)."""
    from openai import OpenAI  # the official SDK, unchanged: the gateway is OpenAI-compatible

    root, files = site_files("traffic", heldout_fraction, cfg.eval_fraction, cfg.code_dir)
    sites = cursor_sites(root, files, cfg.conversations, cfg.seed, cfg.context_bytes, min_intended=4)
    client = OpenAI(base_url=gateway_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=120)
    tally = ChatTally()
    with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as http:
        for i, site in enumerate(sites):
            if stop is not None and stop.is_set():
                break
            rng, conv = random.Random(f"chat/{cfg.seed}/{i}"), Conversation(site)
            messages = [{"role": "user", "content": ASK.format(prompt=site.prompt)}]
            try:
                for _ in range(cfg.max_turns):
                    extra = {"conversation_id": conv.request_ids[0]} if conv.request_ids else {}
                    r = client.chat.completions.create(
                        model=model,
                        messages=messages,
                        max_tokens=cfg.max_tokens,
                        temperature=cfg.temperature,
                        seed=rng.randrange(2**31),
                        user=f"chat-{cfg.seed}-{i}",
                        extra_body=extra,
                    )
                    conv.request_ids.append(r.id)
                    tally.arms[(r.model_extra or {}).get("tidal", {}).get("arm", "unknown")] += 1
                    reply = r.choices[0].message.content or ""
                    conv.thumbs, conv.score, conv.similarity = rate(first_line(reply, site.prompt), site.intended, cfg.up_at)
                    if conv.thumbs == "up":
                        break
                    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": AGAIN}]
                last = conv.request_ids[-1]
                http.post("/v1/feedback", json={"request_id": last, "event": "thumbs", "thumbs": conv.thumbs}).raise_for_status()
                http.post("/v1/feedback", json={"request_id": last, "event": "score", "score": conv.score}).raise_for_status()
            except Exception as e:  # noqa: BLE001  a failed conversation is counted; the others go on
                tally.errors[type(e).__name__] += 1
                conv.thumbs = ""
            tally.conversations.append(conv)
    return tally
