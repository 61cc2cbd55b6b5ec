"""Settings: defaults, environment and YAML sources, and the errors a bad value produces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving.settings import ServingSettings, load_serving_settings
from tidal.section import SettingsError
from tidal.settings import TidalSettings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No inherited TIDAL_* variables, and a working directory without a tidal.yaml."""
    for name in list(os.environ):
        if name.startswith("TIDAL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def settings_error(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None, yaml: str | None = None, tmp: Path | None = None
) -> str:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    if yaml is not None:
        write_config(tmp / "tidal.yaml", yaml)
    with pytest.raises(SettingsError) as exc:
        load_settings()
    return str(exc.value)


# ---- defaults and sources -------------------------------------------------------------------------


def test_defaults_load_without_any_config(clean_env: Path) -> None:
    s = load_settings()
    assert isinstance(s, TidalSettings)
    assert [m.name for m in s.models] == ["tab"]
    assert s.models[0].replicas == 1 and s.models[0].update_strategy == "lora"
    assert (s.prefect.port, s.mlflow.port, s.fleet.admin_port, s.fleet.base_port) == (4200, 5000, 8090, 8100)
    assert s.engine.max_loras >= 2
    assert s.data_path == (clean_env / ".tidal").resolve()
    assert s.run_dir == s.data_path / "run" and s.log_dir == s.data_path / "logs"


def test_store_url_defaults_to_a_file_uri_under_data_dir(clean_env: Path) -> None:
    s = load_settings()
    assert s.store_url == (clean_env / ".tidal" / "store").resolve().as_uri()
    assert s.store_url.startswith("file://")


def test_store_url_follows_data_dir_and_explicit_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "state"))
    assert load_settings().store_url == (tmp_path / "state" / "store").as_uri()
    monkeypatch.setenv("TIDAL_STORE__URL", "s3://bucket/tidal")
    assert load_settings().store_url == "s3://bucket/tidal"


def test_env_overrides_nested_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_FLEET__BASE_PORT", "8300")
    s = load_settings()
    assert s.fleet.base_port == 8300
    assert s.fleet.admin_port == 8090  # siblings keep their defaults


def test_yaml_from_tidal_config_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "elsewhere.yaml", "fleet:\n  base_port: 8400\n  port_range: 50\nmlflow:\n  port: 5055\n")
    monkeypatch.setenv("TIDAL_CONFIG", str(cfg))
    s = load_settings()
    assert (s.fleet.base_port, s.fleet.port_range, s.mlflow.port) == (8400, 50, 5055)


def test_tidal_yaml_in_working_directory_is_read_without_tidal_config(clean_env: Path) -> None:
    write_config(clean_env / "tidal.yaml", "prefect:\n  port: 4300\n")
    assert load_settings().prefect.port == 4300


def test_env_wins_over_yaml_and_nested_sections_merge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", "fleet:\n  base_port: 8400\n  admin_port: 9001\n")
    monkeypatch.setenv("TIDAL_CONFIG", str(cfg))
    monkeypatch.setenv("TIDAL_FLEET__BASE_PORT", "8600")
    s = load_settings()
    assert s.fleet.base_port == 8600  # from the environment
    assert s.fleet.admin_port == 9001  # from the file, same section


def test_one_demo_setting_keeps_the_demos_other_defaults(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    default = load_settings().demo
    assert default.train.ppo.kept_credit_coef != TidalSettings().train.ppo.kept_credit_coef  # the demo's own defaults
    write_config(clean_env / "tidal.yaml", "demo:\n  canary:\n    min_samples: 99\n")
    monkeypatch.setenv("TIDAL_DEMO__TRAIN__PPO__HINDSIGHT_PARTIALS", "true")
    demo = load_settings().demo
    assert demo.train.ppo.hindsight_partials and demo.canary.min_samples == 99
    want_ppo = default.train.ppo.model_dump() | {"hindsight_partials": True}
    assert demo.train.ppo.model_dump() == want_ppo and demo.train.gate == default.train.gate
    assert demo.canary.model_dump() == default.canary.model_dump() | {"min_samples": 99}


def test_nested_model_list_from_yaml(clean_env: Path) -> None:
    write_config(
        clean_env / "tidal.yaml",
        "models:\n"
        "  - name: tab\n    replicas: 2\n    update_strategy: restart\n"
        "  - name: code-x\n    replicas: 0\n    serve_alias: candidate\n",
    )
    s = load_settings()
    assert [m.name for m in s.models] == ["tab", "code-x"]
    tab, code = s.model("tab"), s.model("code-x")
    assert (tab.replicas, tab.update_strategy, tab.serve_alias) == (2, "restart", "champion")
    assert (code.replicas, code.update_strategy, code.serve_alias) == (0, "lora", "candidate")


def test_max_loras_one_is_fine_without_lora_models(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    write_config(clean_env / "tidal.yaml", "models:\n  - name: tab\n    update_strategy: restart\n")
    monkeypatch.setenv("TIDAL_ENGINE__MAX_LORAS", "1")
    assert load_settings().engine.max_loras == 1


def test_overrides_passed_to_load_settings(clean_env: Path) -> None:
    s = load_settings(fleet={"base_port": 9100})
    assert s.fleet.base_port == 9100


# ---- errors ---------------------------------------------------------------------------------------


def test_null_in_the_environment_unsets_an_optional_setting(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    assert load_settings().demo.train.ppo.final_norm_learning_rate is not None  # the demo's default sets it
    monkeypatch.setenv("TIDAL_DEMO__TRAIN__PPO__FINAL_NORM_LEARNING_RATE", "null")
    monkeypatch.setenv("TIDAL_DEMO__TRAIN__PPO__LORA", "true")
    monkeypatch.setenv("TIDAL_DEMO__UPDATE_STRATEGY", "lora")
    demo = load_settings().demo
    assert demo.train.ppo.final_norm_learning_rate is None and demo.train.ppo.lora and demo.update_strategy == "lora"


def test_bad_env_value_names_field_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_FLEET__BASE_PORT": "-1"})
    assert "fleet.base_port" in msg
    assert "TIDAL_FLEET__BASE_PORT" in msg and "tidal.yaml" in msg
    assert "-1" in msg


def test_bad_ppo_combination_names_the_section_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_TRAIN__PPO__MINIBATCH_SIZE": "7"})
    assert "train.ppo" in msg and "batch_size=64 is not a multiple of minibatch_size=7" in msg
    assert "TIDAL_TRAIN__PPO" in msg


def test_train_section_reads_env_overrides(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    monkeypatch.setenv("TIDAL_TRAIN__PPO__LEARNING_RATE", "3e-4")
    monkeypatch.setenv("TIDAL_TRAIN__GATE__MAX_KL", "0.2")
    s = load_settings()
    assert s.train.ppo.learning_rate == 3e-4 and s.train.gate.max_kl == 0.2 and s.train.ppo.lora is True


def test_negative_replica_count(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="models:\n  - name: tab\n    replicas: -1\n", tmp=clean_env)
    assert "models.0.replicas" in msg
    assert "greater than or equal to 0" in msg
    assert "tidal.yaml" in msg


def test_unknown_update_strategy(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="models:\n  - name: tab\n    update_strategy: hotswap\n", tmp=clean_env)
    assert "models.0.update_strategy" in msg
    assert "hotswap" in msg
    for allowed in ("lora", "restart", "reload", "nccl"):
        assert allowed in msg


def test_demo_strategy_that_cannot_serve_its_candidates(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="demo:\n  update_strategy: lora\n", tmp=clean_env)
    assert "demo.update_strategy='lora' with demo.train.ppo.lora=false" in msg
    assert "serve the model with 'restart'" in msg  # the fix


def test_bad_model_name(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="models:\n  - name: Bad Name\n", tmp=clean_env)
    assert "models.0.name" in msg


def test_duplicate_model_names(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="models:\n  - name: tab\n  - name: tab\n", tmp=clean_env)
    assert "model names must be unique" in msg
    assert "tab" in msg


def test_two_services_on_one_port(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_MLFLOW__PORT": "4200"})
    assert "ports must differ" in msg
    assert "prefect.port" in msg and "mlflow.port" in msg


def test_service_port_inside_replica_range(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_PREFECT__PORT": "8150"})
    assert "prefect.port" in msg
    assert "replica range" in msg and "fleet.base_port" in msg


def test_replica_range_past_last_port(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_FLEET__BASE_PORT": "65500"})
    assert "65535" in msg and "fleet.port_range" in msg


def test_max_loras_one_with_a_lora_model(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_ENGINE__MAX_LORAS": "1"})
    assert "engine.max_loras >= 2" in msg
    assert "lora" in msg


def test_tidal_config_pointing_to_missing_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    msg = settings_error(monkeypatch, env={"TIDAL_CONFIG": str(missing)})
    assert "TIDAL_CONFIG" in msg
    assert str(missing) in msg


def test_unknown_top_level_key(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="replica_count: 3\n", tmp=clean_env)
    assert "replica_count" in msg
    assert "not permitted" in msg


def test_unknown_nested_key_is_also_refused(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, yaml="fleet:\n  baseport: 8200\n", tmp=clean_env)
    assert "fleet.baseport" in msg


def test_every_bad_field_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_FLEET__BASE_PORT": "0", "TIDAL_MLFLOW__WORKERS": "0"})
    assert "fleet.base_port" in msg and "mlflow.workers" in msg
    assert msg.startswith("invalid Tidal settings:")


def test_unknown_model_lookup_names_configured_models(clean_env: Path) -> None:
    write_config(clean_env / "tidal.yaml", "models:\n  - name: tab\n  - name: chat\n")
    s = load_settings()
    with pytest.raises(SettingsError) as exc:
        s.model("nope")
    msg = str(exc.value)
    assert "'nope'" in msg
    assert "tab" in msg and "chat" in msg


def _hinted_variable(msg: str) -> str:
    return msg.rsplit(" or ", 1)[1].rstrip(")").strip()


def test_hinted_variable_fixes_a_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_FLEET__BASE_PORT": "-1"})
    var = _hinted_variable(msg)
    assert var == "TIDAL_FLEET__BASE_PORT"
    monkeypatch.setenv(var, "8300")
    assert load_settings().fleet.base_port == 8300


def test_hinted_variable_fixes_a_bad_model_field(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    msg = settings_error(monkeypatch, env={"TIDAL_MODELS": '[{"name": "tab", "replicas": -1}]'})
    var = _hinted_variable(msg)
    assert var == "TIDAL_MODELS"  # a list item is set through the whole list
    monkeypatch.setenv(var, '[{"name": "tab", "replicas": 2}]')
    assert load_settings().models[0].replicas == 2


def test_prefect_server_gets_its_database_wait_from_settings(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    from tidal.platform import Platform

    monkeypatch.setenv("TIDAL_PREFECT__DATABASE_TIMEOUT_S", "45")
    env = Platform(load_settings()).services()["prefect"].env
    assert env["PREFECT_SERVER_DATABASE_TIMEOUT"] == env["PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT"] == "45.0"


def test_sandbox_config_sections_merge_with_the_sandboxes_own(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    from tidal.sandbox import write_config

    path = write_config(
        clean_env, [{"name": "tab"}], base_port=21000, gateway={"logsink": {"segment_max_age_s": 5.0}}, canary={"steps": [0.5]}
    )
    monkeypatch.setenv("TIDAL_CONFIG", str(path))
    s = load_settings()
    assert s.gateway.logsink.segment_max_age_s == 5.0 and s.gateway.logsink.upload_interval_s == 0.5  # merged, not replaced
    assert s.gateway.port == 21004 and [c.client_id for c in s.gateway.clients] == ["alice", "bob"]
    assert s.canary.steps == [0.5]


def test_a_model_sets_its_own_canary_margins(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    from tidal.sandbox import write_config

    path = write_config(
        clean_env,
        [{"name": "tab", "canary_margins": {"accepted_chars": 0.2}}, {"name": "chat"}],
        base_port=21000,
        canary={"margins": {"error_rate": 0.01}},
    )
    monkeypatch.setenv("TIDAL_CONFIG", str(path))
    s = load_settings()
    assert s.model("tab").canary_margins.accepted_chars == 0.2 and s.model("chat").canary_margins is None
    assert (s.canary.margins.error_rate, s.canary.margins.accepted_chars) == (0.01, 0.05)
    monkeypatch.setenv("TIDAL_CANARY__MARGINS__ACCEPTED_CHARS", "1.5")
    with pytest.raises(SettingsError, match="accepted_chars"):
        load_settings()


# ---- credentials -------------------------------------------------------------------------------------


def test_a_bad_credential_setting_is_named_but_never_echoed(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    short_token = "tok-9f8e7d"  # too short to be an admin token, still a secret
    text = settings_error(
        monkeypatch, yaml=f"admin_token: {short_token}\ngateway:\n  clients:\n    - key: alice-key-0123456789\n", tmp=clean_env
    )
    assert "admin_token" in text and "at least 16 characters" in text
    assert "gateway.clients.0.client_id" in text  # missing: its input is the whole entry, key included
    assert short_token not in text and "alice-key-0123456789" not in text
    # an ordinary setting still shows what was given
    assert "'many'" in settings_error(monkeypatch, env={"TIDAL_FLEET__HEALTH_FAILURES": "many"})


def test_secrets_are_generated_once_atomically_private_and_refused_when_empty(clean_env: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tidal.tokens import MIN_SECRET_CHARS, admin_token, secret

    settings = load_settings(data_dir=clean_env / "data")
    with ThreadPoolExecutor(8) as pool:  # racing first uses all get the one secret that was written
        values = set(pool.map(lambda _: secret(settings.data_path, "racy"), range(32)))
    path = settings.data_path / "secrets" / "racy"
    assert len(values) == 1 and len(values.pop()) >= MIN_SECRET_CHARS
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["racy"]  # no temporary file left behind

    # A crash between create and write once left an empty file, and an empty token equalled a missing header.
    (settings.data_path / "secrets" / "admin_token").write_text("")
    with pytest.raises(SettingsError, match="admin_token is empty.*delete the file"):
        admin_token(settings)
    with pytest.raises(SettingsError, match="configured request_id is 5 characters"):
        secret(settings.data_path, "request_id", given="short")


def test_the_settings_file_for_child_processes_is_private_before_it_has_its_name(clean_env: Path, monkeypatch) -> None:
    """It was written with the umask's mode (0644: it may hold keys) and only then made 0600."""
    import tidal.platform as platform_module
    from tidal.platform import Platform

    previous_umask = os.umask(0o022)
    modes = []
    real_replace = os.replace

    def replace(src, dst):
        modes.append(os.stat(src).st_mode & 0o777)
        real_replace(src, dst)

    monkeypatch.setattr(platform_module.os, "replace", replace)
    platform = Platform(load_settings(data_dir=clean_env / "data", admin_token="an-admin-token-0123456789"))
    try:
        platform.write_settings_file()
        platform.write_settings_file()  # and again over the first
    finally:
        os.umask(previous_umask)
    assert modes == [0o600, 0o600]
    assert platform.settings_file.stat().st_mode & 0o777 == 0o600
    assert "an-admin-token-0123456789" in platform.settings_file.read_text()
    assert [p.name for p in platform.settings_file.parent.iterdir()] == ["settings.yaml"]


def test_a_first_byte_timeout_longer_than_the_whole_call_is_refused(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    text = settings_error(monkeypatch, env={"TIDAL_GATEWAY__FIRST_BYTE_TIMEOUT_S": "300"})
    assert "first_byte_timeout_s=300 exceeds gateway.upstream_timeout_s=120" in text and "raise upstream_timeout_s" in text


# ---- each component's root ------------------------------------------------------------------------


def test_the_serving_processes_read_their_sections_of_the_shared_file(clean_env: Path) -> None:
    write_config(
        clean_env / "tidal.yaml",
        "fleet: {admin_port: 8300}\ngateway: {port: 8301}\n"
        "models: [{name: tab, replicas: 2, canary_margins: {accepted_chars: 0.2}}]\n"
        "train: {ppo: {learning_rate: 0.001}}\ndemo: {cycles: 2}\n",
    )
    serving, whole = load_serving_settings(), load_settings()
    assert type(serving) is ServingSettings and isinstance(whole, ServingSettings)
    # the same file gives the serving processes what the CLI passes them, and none of the other planes' sections
    assert serving.model_dump() == {k: v for k, v in whole.model_dump().items() if k in ServingSettings.model_fields}
    assert (serving.fleet.admin_port, serving.gateway.port, serving.model("tab").replicas) == (8300, 8301, 2)
    assert not hasattr(serving, "train") and whole.train.ppo.learning_rate == 0.001


def test_the_serving_root_checks_its_own_combinations(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    monkeypatch.setenv("TIDAL_GATEWAY__PORT", "8090")  # the fleet supervisor's admin port
    with pytest.raises(SettingsError, match="ports must differ"):
        load_serving_settings()


def test_only_the_whole_root_refuses_keys_of_no_section(clean_env: Path) -> None:
    write_config(clean_env / "tidal.yaml", "fleet: {admin_port: 8300}\ntrian: {}\n")
    assert load_serving_settings().fleet.admin_port == 8300  # a component reads its sections and leaves the rest
    with pytest.raises(SettingsError, match="trian"):
        load_settings()  # `tidal up` reads every section first, so the typo stops the platform before it starts


def test_an_admin_header_is_authorized_only_with_the_exact_token() -> None:
    from tidal.tokens import admin_authorized, bearer

    token = "a" * 32
    assert bearer("Bearer  key ") == "key" and bearer("") == ""
    assert admin_authorized(f"Bearer {token}", token)
    assert not any(admin_authorized(h, token) for h in ("", "Bearer ", f"Bearer {token[:-1]}", f"Bearer {token}x", token[:-1]))


# ---- settings of two planes that must agree -------------------------------------------------------


def test_a_collect_context_shorter_than_the_engines_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = settings_error(monkeypatch, {"TIDAL_ENGINE__MAX_MODEL_LEN": "4096"})
    assert "collect.max_model_len=512 is below engine.max_model_len=4096" in msg
    assert "set collect.max_model_len to 4096" in msg
    monkeypatch.setenv("TIDAL_COLLECT__MAX_MODEL_LEN", "4096")
    assert load_settings().collect.max_model_len == 4096


def test_a_lora_rank_the_engines_cannot_load_is_refused_only_where_adapters_are_served(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    monkeypatch.setenv("TIDAL_TRAIN__PPO__LORA_RANK", "16")
    msg = settings_error(monkeypatch)  # the default model is served with the 'lora' strategy
    assert "train.ppo.lora_rank=16 is above engine.max_lora_rank=8" in msg and "set engine.max_lora_rank to 16" in msg
    write_config(clean_env / "tidal.yaml", "models: [{name: tab, update_strategy: reload}]\n")
    assert load_settings().train.ppo.lora_rank == 16  # merged into full checkpoints: no adapter is loaded
    monkeypatch.setenv("TIDAL_ENGINE__MAX_LORA_RANK", "16")
    write_config(clean_env / "tidal.yaml", "models: [{name: tab}]\n")
    assert load_settings().engine.max_lora_rank == 16


def test_a_code_loss_on_a_model_without_corpus_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    write_config(clean_env / "tidal.yaml", "models: [{name: chat, corpus: {source: none}}]\n")
    assert load_settings().model("chat").corpus.source == "none"  # no code loss asked for: fine
    monkeypatch.setenv("TIDAL_TRAIN__PPO__PTX_COEF", "0.5")
    msg = settings_error(monkeypatch)
    assert "model chat has no corpus (models[].corpus.source: none) but train.ppo.ptx_coef=0.5" in msg
    assert "set train.ppo.ptx_coef to 0" in msg


def test_the_probe_bound_follows_the_serving_precision(clean_env: Path) -> None:
    from serving.settings import EngineSettings, FleetSettings

    fleet = FleetSettings()
    assert fleet.probe_tolerance(EngineSettings()) == fleet.probe_atol == 2e-3  # float32
    assert fleet.probe_tolerance(EngineSettings(dtype="bfloat16")) == fleet.probe_atol_by_dtype["bfloat16"] > 2e-3
    assert fleet.probe_tolerance(EngineSettings(dtype="float16")) == 2e-3  # unmeasured: strict, never unchecked
    fp8 = FleetSettings(probe_atol_by_dtype={"bfloat16": 0.06, "fp8": 0.2})
    assert fp8.probe_tolerance(EngineSettings(dtype="bfloat16", quantization="fp8")) == 0.2


def test_pretraining_windows_past_the_policys_context_are_refused(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    monkeypatch.setenv("TIDAL_BOOTSTRAP__PRETRAIN__SEQ_LEN", "4096")
    assert "bootstrap.pretrain.seq_len=4096 exceeds bootstrap.policy.max_position_embeddings=1024" in settings_error(monkeypatch)
    monkeypatch.setenv("TIDAL_BOOTSTRAP__POLICY__MAX_POSITION_EMBEDDINGS", "4096")
    assert load_settings().bootstrap.pretrain.seq_len == 4096


def test_a_bootstrap_the_engines_could_not_serve_is_refused_before_pretraining() -> None:
    from tasks.bootstrap import refuse_short_context
    from tidal.section import SettingsError
    from training.train_settings import BootstrapSettings

    refuse_short_context(BootstrapSettings(), 1024)
    with pytest.raises(SettingsError, match=r"max_position_embeddings=1024 is below engine.max_model_len=4096.*raise .* to 4096"):
        refuse_short_context(BootstrapSettings(), 4096)
