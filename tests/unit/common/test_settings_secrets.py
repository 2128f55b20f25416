"""API key settings: flag, PDSERVE_API_KEY and config file; never on a child's command line
or in an error message."""
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.settings import RouterSettings, child_environ, resolve_router_settings, to_argv

NO_ENV: dict[str, str] = {}


def test_keys_from_flag_env_and_config_file(tmp_path: Path) -> None:
    assert resolve_router_settings(["--api-key", "a,b", "--api-key", "c"], NO_ENV).api_key == ("a", "b", "c")
    assert resolve_router_settings([], {"PDSERVE_API_KEY": " a , b "}).api_key == ("a", "b")
    config = tmp_path / "router.yaml"
    config.write_text("api_key: [a, b]\napi-keys-file: /etc/keys\nprotect-metrics: true\n")
    settings = resolve_router_settings(["--config", str(config)], NO_ENV)
    assert (settings.api_key, settings.api_keys_file, settings.protect_metrics) == (("a", "b"), "/etc/keys", True)
    assert resolve_router_settings([], NO_ENV).has_api_keys is False


@pytest.mark.parametrize("raw", ["good,bad key", "good,,other", "k\u00e9y"])
def test_a_bad_key_is_refused_without_quoting_it(raw: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_router_settings([], {"PDSERVE_API_KEY": raw})
    assert caught.value.field == "PDSERVE_API_KEY"
    assert "good" not in str(caught.value) and "k\u00e9y" not in str(caught.value)


def test_protect_metrics_needs_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_router_settings(["--protect-metrics"], NO_ENV)
    assert caught.value.field == "--protect-metrics"


def test_keys_reach_a_child_in_its_environment_never_on_its_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "stale")
    router = RouterSettings(model="/m/x.gguf", api_key=("s3cret-1", "s3cret-2"), api_keys_file="/k", protect_metrics=True)
    argv = to_argv(router)
    assert not any("s3cret" in arg for arg in argv) and "--api-key" not in argv
    env = child_environ(router)
    assert env["PDSERVE_API_KEY"] == "s3cret-1,s3cret-2"
    assert resolve_router_settings(argv, env) == router
    assert "s3cret" not in repr(router)
    assert "PDSERVE_API_KEY" not in child_environ(RouterSettings(model="/m/x.gguf"))
    assert "PDSERVE_API_KEY" not in child_environ()
