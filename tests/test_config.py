"""Configuration: types, bounds, unknown keys, interpolation, env overrides, file:line errors."""

from __future__ import annotations

import pytest

from taproom.config import describe_defaults, load_config
from taproom.errors import ConfigError


def load(text: str, env: dict[str, str] | None = None, path: str | None = None):
    return (
        load_config(text=text, env=env or {}) if path is None else load_config(path, env=env or {})
    )


def test_defaults_run_everything_on_loopback_with_journal_in_var():
    config = load("")
    assert config.journal.dir == "./var/journal"
    assert config.journal.fsync == "always"
    hosts = {getattr(config.section(n), "host", "127.0.0.1") for n in config.names}
    assert hosts == {"127.0.0.1"}


def test_every_setting_says_why_its_default():
    missing = [f"{s}.{k}" for s, k, _d, why in describe_defaults() if not why]
    assert missing == []


def test_unknown_key_names_file_line_and_key(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[journal]\nfsync = "always"\n\nfsynk = "off"\n')
    with pytest.raises(ConfigError) as err:
        load("", path=str(path))
    assert str(err.value).startswith(f"{path}:4: journal.fsynk: unknown key")


def test_a_retired_key_loads_and_is_named_with_file_and_line(tmp_path):
    """A setting a release removed (Lumberjack's per-window bounds, issue 24) must not stop a
    hub that is upgraded with its old file: it loads, the key is ignored and named."""
    path = tmp_path / "old.toml"
    path.write_text(
        "[lumberjack]\nport = 0\nmax_frame_bytes = 16777216\n\n[lager]\ninput_hwm = 5\n"
    )
    config = load("", path=str(path))
    assert config.lumberjack.port == 0
    assert not hasattr(config.lumberjack, "max_frame_bytes")
    assert [w.split(": retired")[0] for w in config.warnings] == [
        f"{path}:3: lumberjack.max_frame_bytes",
        f"{path}:6: lager.input_hwm",
    ]
    assert all("retired, ignored: " in w for w in config.warnings)
    assert load("[lumberjack]\nport = 0\n").warnings == ()


def test_unknown_section():
    with pytest.raises(ConfigError) as err:
        load("[journl]\ndir = 'x'\n")
    assert err.value.line == 1 and err.value.key == "journl"


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("[journal]\nfsync = 'sometimes'\n", "journal.fsync", "not one of"),
        ("[journal]\nsegment_bytes = 10\n", "journal.segment_bytes", "below the minimum"),
        ("[web]\nport = 70000\n", "web.port", "above the maximum"),
        ("[web]\nport = 'eighty'\n", "web.port", "expected an integer"),
        ("[web]\nenabled = 3\n", "web.enabled", "expected true or false"),
        ("[hub]\nname = 5\n", "hub.name", "expected a string"),
    ],
)
def test_wrong_types_and_impossible_values(text, key, fragment):
    with pytest.raises(ConfigError) as err:
        load(text)
    assert err.value.key == key
    assert fragment in err.value.message
    assert err.value.line == 2


def test_invalid_toml_gives_line():
    with pytest.raises(ConfigError) as err:
        load("[journal]\ndir = \n")
    assert err.value.line == 2


def test_interpolation_forms():
    text = '[journal]\ndir = "${BASE}/j"\n[hub]\nname = "${NAME:-fallback}"\n[web]\nport = "${PORT:-9999}"\n'
    config = load(text, env={"BASE": "/data"})
    assert config.journal.dir == "/data/j"
    assert config.hub.name == "fallback"
    assert config.web.port == 9999  # interpolated strings are coerced to the setting's type


def test_required_variable_message():
    with pytest.raises(ConfigError) as err:
        load('[journal]\ndir = "${DATA:?set DATA to the journal disk}"\n')
    assert "set DATA to the journal disk" in str(err.value) and err.value.line == 2


def test_unset_variable_without_default_is_an_error():
    with pytest.raises(ConfigError, match=r"\$\{NOPE\} is not set"):
        load('[journal]\ndir = "${NOPE}"\n')


def test_environment_overrides_win_and_are_typed():
    config = load(
        "[web]\nport = 1\n",
        env={
            "TAPROOM_WEB__PORT": "2345",
            "TAPROOM_JOURNAL__FSYNC": "off",
            "TAPROOM_WEB__ENABLED": "false",
        },
    )
    assert config.web.port == 2345 and config.journal.fsync == "off" and config.web.enabled is False


def test_environment_override_is_validated():
    with pytest.raises(ConfigError) as err:
        load("", env={"TAPROOM_JOURNAL__FSYNC": "never"})
    assert err.value.key == "journal.fsync"


@pytest.mark.parametrize(
    ("line", "key", "fragment"),
    [
        ('enabled = "false"', "web.enabled", "expected true or false, got 'false'"),
        ('port = "8080"', "web.port", "expected an integer, got '8080'"),
        ("port = 80.5", "web.port", "expected an integer, got 80.5"),
        ("host = 127", "web.host", "expected a string, got 127"),
        ("max_connections = true", "web.max_connections", "expected an integer, got True"),
    ],
)
def test_a_toml_value_of_the_wrong_type_names_file_line_and_key(tmp_path, line, key, fragment):
    # Strings stand for numbers and booleans only where they come from the environment: a
    # quoted "false" in the file is a mistake, and silently reading it as false (or, worse,
    # as true) hides it.
    path = tmp_path / "t.toml"
    path.write_text(f"# ops endpoints\n[web]\n{line}\n")
    with pytest.raises(ConfigError) as err:
        load("", path=str(path))
    assert str(err.value).startswith(f"{path}:3: {key}: ")
    assert fragment in err.value.message


def test_interpolated_strings_still_stand_for_booleans_and_numbers():
    config = load(
        '[web]\nenabled = "${WEB_ON}"\nport = "${PORT}"\n[hub]\ngrace_period_s = "${GRACE}"\n',
        env={"WEB_ON": "false", "PORT": "0x10", "GRACE": "2.5"},
    )
    assert config.web.enabled is False and config.web.port == 16
    assert config.hub.grace_period_s == 2.5


def test_environment_text_is_taken_as_text_for_string_settings():
    # TAPROOM_HUB__NAME=123 names the hub "123"; it is not the integer 123.
    env = {"TAPROOM_HUB__NAME": "123", "TAPROOM_LUMBERJACK__HOST": "true"}
    # ("true" is a host name, not loopback: exposed on purpose, or validate refuses it)
    config = load("", env={**env, "TAPROOM_ACCESS__LUMBERJACK__OPEN": "true"})
    assert config.hub.name == "123" and config.lumberjack.host == "true"
    config = load("", env={"TAPROOM_LUMBERJACK__STREAM_FIELDS": '["app", "service"]'})
    assert config.lumberjack.stream_fields == ("app", "service")


def test_a_bad_environment_override_names_the_variable_not_the_file_line(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[journal]\nfsync = "always"\n')
    with pytest.raises(ConfigError) as err:
        load("", path=str(path), env={"TAPROOM_JOURNAL__FSYNC": "never"})
    message = str(err.value)
    assert message.startswith("environment variable TAPROOM_JOURNAL__FSYNC: journal.fsync: ")
    assert "'never' is not one of" in message
    assert f"{path}:2" not in message and err.value.line is None
    with pytest.raises(ConfigError) as err:
        load("[web]\nport = 1\n", env={"TAPROOM_WEB__PORT__X": "1"})
    assert str(err.value).startswith("environment variable TAPROOM_WEB__PORT__X: web.port: ")


def test_a_config_file_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "t.toml"
    path.write_bytes(b'[hub]\n# operator\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError) as err:
        load("", path=str(path))
    assert str(err.value).startswith(f"{path}:3: not UTF-8")


@pytest.mark.parametrize("below", ["", "/sub"])
def test_a_journal_dir_that_is_a_file_is_a_config_error(tmp_path, below):
    afile = tmp_path / "afile"
    afile.write_text("")
    path = tmp_path / "t.toml"
    path.write_text(f'[journal]\ndir = "{afile}{below}"\n')
    with pytest.raises(ConfigError) as err:
        load("", path=str(path))
    assert str(err.value).startswith(f"{path}:2: journal.dir: ")
    assert f"{afile} is not a directory" in err.value.message
