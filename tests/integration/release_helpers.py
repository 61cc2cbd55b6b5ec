"""What the release tests share: simulated Tab users, candidate adapters built for a purpose (degraded, better,
neutral), `tidal promote` in a subprocess, and waits on the audit trail."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from data_contracts import corpus


def cursor_prompts(settings, n: int, seed: int) -> list[tuple[str, str]]:
    """(code before the cursor, rest of its line) at random mid-line positions of held-out stdlib files."""
    root = corpus.stdlib_root()
    _, heldout = corpus.split_stdlib(settings.bootstrap.heldout_fraction, root)
    texts = corpus.read_texts(heldout[:100])
    rng, out = random.Random(seed), []
    while len(out) < n:
        text = texts[rng.randrange(len(texts))]
        cut = rng.randrange(1, len(text))
        end = text.find("\n", cut)
        intended = text[cut : end if end != -1 else len(text)]
        if intended.strip() and not text[cut - 1].isspace():
            out.append((text[max(0, cut - 300) : cut], intended))
    return out


class Users(threading.Thread):
    """Tab users at random cursor positions of held-out code: they accept a suggestion that stays on the
    current line and reject one that runs over it. (The sandbox's 25-second base model rarely predicts
    the exact rest of a line, so exact-match users would give too few accepts to compare arms in a test.)
    Runs until stopped; counts requests per arm and errors."""

    def __init__(
        self,
        gateway: str,
        key: str,
        prompts: list[tuple[str, str]],
        users: int = 400,
        model: str = "tab",
        stop: list[str] | None = None,
    ):
        super().__init__(daemon=True)
        self.gateway, self.key, self.prompts, self.users, self.model = gateway, key, prompts, users, model
        self.extra = {"stop": stop} if stop else {}  # with stop ["\n"], a suggestion that starts a new line is empty
        self.stop, self.errors, self.by_arm = threading.Event(), [], {}

    def one(self, i: int) -> None:
        prompt, _ = self.prompts[i % len(self.prompts)]
        h = {"Authorization": f"Bearer {self.key}"}
        try:
            r = httpx.post(
                self.gateway + "/v1/completions",
                headers=h,
                timeout=60,
                json={
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": 6,
                    "temperature": 1.0,
                    "user": f"user-{i % self.users}",
                    **self.extra,
                },
            )
            r.raise_for_status()
            a = r.json()
            text, arm = a["choices"][0]["text"], a["tidal"]["arm"]
            self.by_arm[arm] = self.by_arm.get(arm, 0) + 1
            if text:
                event = "rejected" if "\n" in text else "accepted"
                httpx.post(
                    self.gateway + "/v1/feedback", headers=h, timeout=30, json={"request_id": a["id"], "event": event}
                ).raise_for_status()
        except Exception as e:  # noqa: BLE001  counted and asserted on
            self.errors.append(repr(e))

    def run(self) -> None:
        # 4 users typing at once, each checking `stop` before every request, so a stop ends the traffic within one
        # request (the test's teardown waits for it; a two-core machine answers a request in seconds under load)
        counter = iter(range(10**9))

        def user() -> None:
            while not self.stop.is_set():
                self.one(next(counter))

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: user(), range(4)))


def newline_adapter(base_dir, out, strength: float = 40.0):
    """A rank-1 LoRA on the last MLP's down projection that adds the newline token's embedding direction to
    the residual stream in proportion to the layer's mean activation: the model breaks lines far more often
    (measured through the fleet: accepted single-line suggestions 70% -> 49% at strength 40)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from training.policy import load_policy, load_tokenizer
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    model, tok = load_policy(base_dir), load_tokenizer(base_dir)
    down = model.model.layers[-1].mlp.down_proj
    acts = []
    hook = down.register_forward_hook(lambda m, i, o: acts.append(i[0].detach().flatten(0, 1)))  # (T, I)
    code = corpus.read_texts([corpus.stdlib_root() / "bisect.py"])[0]
    with torch.no_grad():
        model(input_ids=torch.tensor([tok.encode(code, add_special_tokens=False)[:256]]))
    hook.remove()
    mean = torch.cat(acts).mean(0)  # (I,) typical input of down_proj
    peft = get_peft_model(model, LoraConfig(r=1, lora_alpha=1, target_modules=["down_proj"]))  # B = 0 elsewhere
    lora = peft.base_model.model.model.layers[-1].mlp.down_proj
    newline = model.get_input_embeddings().weight[tok.encode("\n", add_special_tokens=False)[0]].detach()  # (H,)
    with torch.no_grad():
        lora.lora_A["default"].weight.copy_((mean / mean.norm()).unsqueeze(0))  # (1, I)
        lora.lora_B["default"].weight.copy_((strength * newline / newline.norm()).unsqueeze(1))  # (H, 1)
    peft.save_pretrained(str(out))
    save_probe(compute_probe(load_policy(out, base_path=base_dir), tok, probe_prompts_of(base_dir)), out)
    return out


def merged(adapter_dir, base_dir, out):
    """The adapter folded into a full checkpoint (what the `restart` strategy serves), with its own probe."""
    from training.policy import load_policy, load_tokenizer, save_policy
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    full = load_policy(adapter_dir, base_path=base_dir).merge_and_unload()
    tok = load_tokenizer(base_dir)
    save_policy(full, tok, out)
    save_probe(compute_probe(full, tok, probe_prompts_of(base_dir)), out)
    return out


def zero_adapter(base_dir, out):
    """A LoRA adapter with B = 0: serves exactly the base's outputs (an A/A candidate), with its own probe."""
    from peft import get_peft_model

    from training.policy import load_policy, load_tokenizer
    from training.ppo_config import PPOConfig
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    get_peft_model(load_policy(base_dir), PPOConfig().lora_config()).save_pretrained(str(out))
    save_probe(compute_probe(load_policy(out, base_path=base_dir), load_tokenizer(base_dir), probe_prompts_of(base_dir)), out)
    return out


def tags(registry, version: int) -> dict:
    return registry.get("tab", version).tags


class Promote:
    """`tidal promote` in a subprocess, its output in a file (a pipe nobody reads would block it)."""

    def __init__(self, version: int, log, env: dict | None = None, model: str = "tab"):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.cli", "promote", model, "--candidate", str(version), "--no-gate"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env or dict(os.environ),
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        return rc, self.log.read_text()


def start_at_first_step(users: Users, registry, promote: Promote | None, version: int, model: str = "tab") -> None:
    """Users start typing once the canary's first step is routed: deploying and verifying the candidate, and the
    canary's read of the users' history, do not share the cores with their traffic (on two cores that read took
    ~20 s under four users, ~1 s without), and the first step starts with users on both arms. promote: the release's
    `tidal promote`, if this test started it (a release another process runs is only waited for)."""
    deadline = time.monotonic() + 600
    while "tidal.release.step_1" not in (seen := registry.get(model, version).tags):
        if promote is not None:
            assert promote.running(), promote.log.read_text()[-3000:]
        assert time.monotonic() < deadline, promote.log.read_text()[-3000:] if promote is not None else seen
        time.sleep(0.5)
    users.start()


def canary_user_share(settings, model: str, users: int, weight: float, client: str = "alice") -> float:
    """The share of `client`'s simulated users `user-0 … user-{users-1}` the gateway's keyed hash puts on a canary."""
    from serving.routes import ArmSpec, ModelRoutes, arm_key, assign, assignment_key
    from tidal.tokens import secret

    key = arm_key(secret(settings.data_path, "request_id", settings.gateway.secret).encode())
    routes = ModelRoutes(
        model=model,
        updated_ms=0,
        updated_by="test",
        arms=[ArmSpec(name="control", version=1, weight=1 - weight), ArmSpec(name="canary", version=2, weight=weight)],
    )
    return sum(assign(routes, assignment_key(client, f"user-{i}"), key).name == "canary" for i in range(users)) / users


def wait_for_tag(registry, promote: Promote, version: int, tag: str, timeout: float = 600, model: str = "tab") -> None:
    deadline = time.monotonic() + timeout
    while f"tidal.release.{tag}" not in registry.get(model, version).tags:
        assert promote.running() and time.monotonic() < deadline, promote.log.read_text()[-3000:]
        time.sleep(0.5)


def tab_arms(platform) -> list[tuple]:
    return [(a.name, a.version, a.weight) for a in platform.routes_client().show().routes["tab"].arms]
