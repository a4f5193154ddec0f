"""Session settings travel as one value, and the environment is read in one place."""

from __future__ import annotations

import warnings

import pytest

from sparse_attention_op import settings
from sparse_attention_op.settings import SessionSettings, SettingsError


def test_settings_round_trip_through_the_node_attribute():
    for value in (SessionSettings(), SessionSettings(kv_check="fast", profile="pass", f16_cache=False)):
        assert SessionSettings.from_attribute(value.to_attribute()) == value


def test_settings_compare_by_value():
    assert SessionSettings(kv_check="fast") == SessionSettings.of(kv_check="fast")
    assert SessionSettings.of(profile=True) == SessionSettings(profile="dispatches")
    assert SessionSettings(kv_check="fast") != SessionSettings(kv_check="exact")


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        (dict(kv_check="quick"), "kv_check must be one of ('exact', 'fast'), got 'quick'"),
        (dict(profile="sometimes"), "profile must be one of ('off', 'dispatches', 'pass'), got 'sometimes'"),
        (dict(f16_cache="yes"), "f16_cache must be True or False, got 'yes'"),
    ],
)
def test_a_bad_setting_names_itself(keywords, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SessionSettings(**keywords)


@pytest.mark.parametrize("text", ["kv_check", "colour=red", "kv_check=fast;kv_check=exact", "f16_cache=2"])
def test_an_unreadable_attribute_is_refused(text):
    with pytest.raises(SettingsError, match="session settings attribute"):
        SessionSettings.from_attribute(text)


def test_the_old_adapter_variable_still_works_with_a_warning(monkeypatch):
    monkeypatch.delenv("SAO_ADAPTER", raising=False)
    monkeypatch.setenv("SPARSE_ATTENTION_OP_ADAPTER", "llvmpipe")
    monkeypatch.setattr(settings, "_warned", set())
    with pytest.warns(FutureWarning, match="SPARSE_ATTENTION_OP_ADAPTER is deprecated: set SAO_ADAPTER"):
        assert settings.environment("SAO_ADAPTER") == "llvmpipe"
    assert settings.environment_name("SAO_ADAPTER") == "SPARSE_ATTENTION_OP_ADAPTER"
    monkeypatch.setenv("SAO_ADAPTER", "lavapipe")  # the new name wins, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings.environment("SAO_ADAPTER") == "lavapipe"


def test_environment_values_are_checked(monkeypatch):
    monkeypatch.setenv("SAO_STAGING_BYTES", "four")
    with pytest.raises(SettingsError, match="SAO_STAGING_BYTES='four' is not an integer"):
        settings.environment_int("SAO_STAGING_BYTES", 0)
    with pytest.raises(KeyError, match="SAO_COLOUR is not one of the package's environment variables"):
        settings.environment("SAO_COLOUR")
    monkeypatch.setenv("SAO_SHADER_CHECKS", "0")
    assert not settings.environment_flag("SAO_SHADER_CHECKS")
    monkeypatch.setenv("SAO_SHADER_CHECKS", "1")
    assert settings.environment_flag("SAO_SHADER_CHECKS")


def test_no_other_module_reads_the_environment():
    from pathlib import Path

    package = Path(settings.__file__).parent
    readers = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "settings.py" and ("os.environ" in p.read_text() or "getenv" in p.read_text())
    ]
    assert readers == []
