"""Each setting is defined once, beside its field in `Settings` (cacheroute_proxy/config.py):
its environment variable, type, default, bounds and help. From that one definition come the
reading of the environment, the error a bad value gets (the variable, the value, the rule),
`cacheroute-proxy config` and the tables of docs/configuration.md, which must be current."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from cacheroute_proxy import settings_table
from cacheroute_proxy.config import ENV_NAMES, FIELDS, ConfigError, Settings
from tests.harness import ROOT

DOC = ROOT / "docs" / "configuration.md"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    return subprocess.run([sys.executable, "-m", "cacheroute_proxy", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=clean)


# --- reading the environment ------------------------------------------------------------------
# The original Proxy's names, with a value that is not the default.
ORIGINAL_NAMES = [
    ("PROXY_INSTANCE_STRATEGY", "least-load", "instance_strategy", "least-load"),
    ("PROXY_INSTANCE_TTL_S", "12", "instance_ttl_s", 12.0),
    ("PROXY_CP_PORT", "9002", "cp_port", 9002),
    ("PROXY_DP_PORT", "9001", "dp_port", 9001),
    ("PREPARE_CONCURRENCY", "3", "prepare_concurrency", 3),
    ("READY_CONCURRENCY", "5", "ready_concurrency", 5),
    ("IWS_KDN_QUEUE_PENALTY_ALPHA", "0.25", "iws_kdn_queue_penalty_alpha", 0.25),
    ("IWS_DECISION_MARGIN_MS", "40", "iws_decision_margin_ms", 40.0),
    ("KDN_DEFAULT_BANDWIDTH_MBPS", "250", "kdn_default_bandwidth_mbps", 250.0),
    ("OPENAI_API_KEY", "k", "openai_api_key", "k"),
    ("SCHEDULER_CP_URL", "http://127.0.0.1:7002", "scheduler_cp_url", "http://127.0.0.1:7002"),
    ("PROXY_ACCESS_LOG", "1", "log_each_request", True),
    ("PROXY_HEARTBEAT_S", "2", "scheduler_heartbeat_s", 2.0),
    ("PROXY_KDN_LINKS_JSON", '{"kdn://a:1": {"bandwidth_mbps": 10}}', "kdn_links",
     {"kdn://a:1": {"bandwidth_mbps": 10}}),
]


@pytest.mark.parametrize(("var", "text", "field", "value"), ORIGINAL_NAMES, ids=[n[0] for n in ORIGINAL_NAMES])
def test_the_original_names_are_read(var: str, text: str, field: str, value: object) -> None:
    assert getattr(Settings.from_env({var: text}), field) == value
    assert ENV_NAMES[field] == var


def test_a_strategy_alias_names_its_strategy() -> None:
    assert Settings.from_env({"PROXY_INSTANCE_STRATEGY": "ll"}).strategy_name == "least_load"


def test_every_setting_has_one_variable_a_topic_and_help() -> None:
    variables = [f.env.var for f in FIELDS]
    assert len(variables) == len(set(variables)) == len(Settings.__struct_fields__)
    assert all(f.env.help.strip() and f.env.topic for f in FIELDS)


def test_an_empty_value_is_the_default_and_settings_round_trip_through_the_environment() -> None:
    assert Settings.from_env({var: "" for var in ENV_NAMES.values()}) == Settings()
    changed = Settings(workers=3, pace_step=0.5, log_each_request=True, advertise_port=9000,
                       least_load_weights={"inflight": 2.0}, static_instances="http://127.0.0.1:8000")
    assert Settings.from_env(changed.to_env()) == changed


# --- what a bad value is told -------------------------------------------------------------------
BAD = [
    ({"PROXY_WORKERS": "0"}, "PROXY_WORKERS: must be between 1 and 256, got 0"),
    ({"PROXY_DP_PORT": "abc"}, "PROXY_DP_PORT: expected an integer, got 'abc'"),
    ({"PROXY_DP_PORT": "70000"}, "PROXY_DP_PORT: must be a TCP port between 1 and 65535, got 70000"),
    ({"PROXY_ADVERTISE_PORT": "0"}, "PROXY_ADVERTISE_PORT: must be a TCP port between 1 and 65535, got 0"),
    ({"PROXY_PACE_STEP": "1.5"}, "PROXY_PACE_STEP: must be between 0 and 1, got 1.5"),
    ({"PROXY_PACE_STEP": "-0.1"}, "PROXY_PACE_STEP: must be between 0 and 1, got -0.1"),
    ({"PROXY_PACE_STEP": "soon"}, "PROXY_PACE_STEP: expected a number, got 'soon'"),
    ({"PROXY_INSTANCE_STRATEGY": "least_inflight"},
     "PROXY_INSTANCE_STRATEGY: unknown strategy 'least_inflight'; choose one of round_robin, "
     "round-robin, rr, least_load, least-load, ll, kv_aware, kv-aware, kv"),
    ({"PROXY_MAX_HEAD_BYTES": "100"}, "PROXY_MAX_HEAD_BYTES: must be between 256 and 1048576, got 100"),
    ({"PROXY_MAX_URL_BYTES": "2000000"}, "PROXY_MAX_URL_BYTES: must be between 256 and 1048576, got 2000000"),
    ({"PROXY_MAX_HEADERS": "0"}, "PROXY_MAX_HEADERS: must be between 1 and 10000, got 0"),
    ({"PROXY_HEAD_TIMEOUT_S": "0"}, "PROXY_HEAD_TIMEOUT_S: must be > 0, got 0.0"),
    ({"PROXY_QUEUE_TIMEOUT_S": "0"}, "PROXY_QUEUE_TIMEOUT_S: must be > 0, got 0.0"),
    ({"PROXY_INSTANCE_PURGE_GRACE_S": "-1"}, "PROXY_INSTANCE_PURGE_GRACE_S: must be >= 0, got -1.0"),
    ({"PROXY_KV_AWARE_BALANCE_REL": "inf"},
     "PROXY_KV_AWARE_BALANCE_REL: must be a finite number >= 1, got inf"),
    ({"PROXY_AFFINITY_PENDING_S": "4000"},
     "PROXY_AFFINITY_PENDING_S: must be a finite number > 0 and <= 3600, got 4000.0"),
    ({"PROXY_LOAD_VIEW": "global"},
     "PROXY_LOAD_VIEW: unknown load view 'global'; choose one of shared, per_worker"),
    ({"PROXY_ACCESS_LOG": "maybe"}, "PROXY_ACCESS_LOG: expected true or false (or 1 or 0), got 'maybe'"),
    ({"PROXY_SHM_NAME": "no-slash"},
     "PROXY_SHM_NAME: must be /name (one leading slash, no other), got 'no-slash'"),
    ({"PROXY_LEAST_LOAD_WEIGHTS": "[1]"},
     "PROXY_LEAST_LOAD_WEIGHTS: expected a JSON object, got '[1]' (Expected `object`, got `array`)"),
    ({"PROXY_LEAST_LOAD_WEIGHTS": "{"}, "PROXY_LEAST_LOAD_WEIGHTS: not valid JSON, got '{'"
                                        " (Input data was truncated)"),
    ({"PROXY_UI_LISTEN": "8202"}, "PROXY_UI_LISTEN: must be HOST:PORT such as 127.0.0.1:8202, got '8202'"),
    ({"SCHEDULER_CP_URL": "127.0.0.1:7002"},
     "SCHEDULER_CP_URL: must be an http(s) URL such as http://127.0.0.1:7002, got '127.0.0.1:7002'"),
]


@pytest.mark.parametrize(("env", "message"), BAD, ids=[f"{var}={text}" for env, _ in BAD for var, text in env.items()])
def test_a_bad_value_is_told_its_variable_value_and_rule(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(env)
    assert str(refused.value) == message


def test_a_setting_given_in_code_is_checked_as_one_from_the_environment() -> None:
    with pytest.raises(ConfigError) as refused:
        Settings(workers=0)
    assert str(refused.value) == "PROXY_WORKERS: must be between 1 and 256, got 0"
    with pytest.raises(ConfigError, match="^PROXY_EJECT_S: must be > 0, got nan$"):
        Settings().with_overrides(eject_s=math.nan)


# --- the listing and the docs ---------------------------------------------------------------------
def test_config_lists_every_setting_with_its_type_default_bounds_and_help() -> None:
    listed = run_cli("config")
    assert listed.returncode == 0, listed.stderr
    for var in ENV_NAMES.values():
        assert var in listed.stdout, var
    workers = listed.stdout[listed.stdout.index("PROXY_WORKERS "):].splitlines()
    assert workers[0].split() == ["PROXY_WORKERS", "integer", "4", "1..256"], workers[0]
    assert "workers started by cacheroute-proxy run" in workers[1]
    assert "PROXY_KV_AWARE_CREDIT_PER_MS" in listed.stdout  # retired, refused at start
    one = run_cli("config", "--json", "shm")
    rows = json.loads(one.stdout)
    assert {row["variable"] for row in rows} == {"PROXY_SHM_NAME", "PROXY_SHM_INSTANCE_CAPACITY",
                                                 "PROXY_SHM_WORKER_CAPACITY"}, rows
    assert next(r for r in rows if r["variable"] == "PROXY_SHM_NAME")["default"] == "/cacheroute_proxy"


def test_the_docs_tables_are_current() -> None:
    text = DOC.read_text()
    assert settings_table.rewrite_doc(text) == text, (
        "docs/configuration.md's settings tables are not what cacheroute_proxy/config.py defines: "
        "run `make config-doc`")


def test_update_doc_rewrites_a_stale_table(tmp_path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text().replace("| `PROXY_DP_PORT` |", "| `PROXY_OLD_PORT` |"))
    assert stale.read_text() != DOC.read_text()
    done = run_cli("config", "--update-doc", str(stale))
    assert done.returncode == 0, done.stderr
    assert stale.read_text() == DOC.read_text()


def test_a_doc_without_a_topics_table_is_refused() -> None:
    text = DOC.read_text()
    start = text.index("<!-- settings: tracing")
    end = text.index("-->", text.index("<!-- end of settings", start)) + 3
    with pytest.raises(ValueError, match="tracing"):
        settings_table.rewrite_doc(text[:start] + text[end:])


def test_the_systemd_environment_file_names_only_settings() -> None:
    example = ROOT / "deploy" / "systemd" / "proxy.env.example"
    named = re.findall(r"^#?([A-Z][A-Z0-9_]*)=", example.read_text(), re.M)
    unknown = set(named) - set(ENV_NAMES.values())
    assert len(named) > 20 and not unknown, f"not a setting: {sorted(unknown)}"
