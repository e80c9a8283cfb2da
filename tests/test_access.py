"""The access policy (taproom.access): rules and their inheritance, the allowlist, CURVE keys,
the connection gate, refusal counting and logging, and the exposure check of validate/serve."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth

from taproom.access import ConnectionGate, access_for, load_curve_keys, open_listeners
from taproom.config import load_config
from taproom.errors import ConfigError
from taproom.metrics import Metrics


def config(text: str):  # type: ignore[no-untyped-def]
    return load_config(text=text, env={})


def refused(metrics: Metrics, listener: str, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "taproom_access_refused_connections_total", {"listener": listener, "reason": reason}
    )
    return value or 0.0


class TestRules:
    def test_defaults_allow_everyone(self) -> None:
        access = access_for(config(""), "logjam_pull")
        assert not access.restricted and access.allows("203.0.113.9") and access.curve is None

    def test_most_specific_table_wins_and_replaces(self) -> None:
        cfg = config(
            '[access]\nallow = ["10.0.0.0/8"]\n'
            '[access.logjam]\nallow = ["192.168.1.7"]\n'
            '[access.logjam_pub]\nallow = ["2001:db8::/32", "::1"]\n'
        )
        assert access_for(cfg, "lumberjack").allows("10.9.8.7")
        pull = access_for(cfg, "logjam_pull")
        assert pull.allows("192.168.1.7") and not pull.allows("10.9.8.7")
        pub = access_for(cfg, "logjam_pub")
        assert pub.allows("2001:db8:1::5") and pub.allows("::1")
        assert not pub.allows("192.168.1.7") and not pub.allows("10.9.8.7")

    @pytest.mark.parametrize(
        ("host", "allowed"),
        [
            ("10.1.2.3", True),
            ("11.0.0.1", False),
            ("::ffff:10.1.2.3", True),  # a dual-stack socket's view of an IPv4 peer
            ("fe80::1%eth0", True),
            ("fe80::2", False),
            ("[fe80::1]", True),
            ("", False),
            (None, False),
            ("not-an-address", False),
        ],
    )
    def test_addresses(self, host: str | None, allowed: bool) -> None:
        access = access_for(config('[access]\nallow = ["10.0.0.0/8", "fe80::1"]\n'), "web")
        assert access.allows(host) is allowed

    @pytest.mark.parametrize(
        ("entry", "message"),
        [
            ("10.0.0.1/8", "did you mean 10.0.0.0/8"),
            ("hub-a.example", "not an address or CIDR network"),
            ("10.0.0.0/33", "not an address or CIDR network"),
        ],
    )
    def test_bad_allow_entries_name_the_line(self, entry: str, message: str) -> None:
        with pytest.raises(ConfigError) as caught:
            config(f'[web]\nport = 1\n[access.web]\nallow = ["{entry}"]\n')
        assert caught.value.line == 4 and caught.value.key == "access.web.allow"
        assert message in str(caught.value)

    def test_curve_is_for_zeromq_listeners_only(self, tmp_path: Path) -> None:
        _, secret = zmq.auth.create_certificates(str(tmp_path), "hub")
        with pytest.raises(ConfigError, match="ZeroMQ listeners only"):
            config(f'[access.lumberjack]\ncurve_secret_key_file = "{secret}"\n')
        config(f'[access.lager]\ncurve_secret_key_file = "{secret}"\n')

    def test_client_keys_need_a_server_key(self, tmp_path: Path) -> None:
        public, _ = zmq.auth.create_certificates(str(tmp_path), "client")
        with pytest.raises(ConfigError, match="no key of its own"):
            config(f'[access.logjam_pull]\ncurve_allowed_clients = "{public}"\n')


class TestCurveKeys:
    def test_key_pair_and_clients_from_files_directories_and_z85(self, tmp_path: Path) -> None:
        hub_public, hub_secret = zmq.auth.create_certificates(str(tmp_path), "hub")
        clients = tmp_path / "clients"
        clients.mkdir()
        a_public, _ = zmq.auth.create_certificates(str(clients), "a")
        b_public, b_secret = zmq.auth.create_certificates(str(tmp_path), "b")
        (clients / "a.key_secret").unlink()  # the hub holds public keys only
        pair = load_curve_keys(hub_secret)
        assert pair.public_z85 == zmq.auth.load_certificate(hub_public)[0]
        a_key = zmq.auth.load_certificate(a_public)[0]
        b_key = zmq.auth.load_certificate(b_public)[0]
        c_public, _ = zmq.curve_keypair()
        listed = f'["{b_public}", "{c_public.decode()}"]'
        cfg = config(
            f'[access.logjam]\ncurve_secret_key_file = "{hub_secret}"\n'
            f'curve_allowed_clients = "{clients}"\n'
            f"[access.logjam_pub]\ncurve_allowed_clients = {listed}\n"
        )
        from zmq.utils import z85

        pull = access_for(cfg, "logjam_pull")
        assert pull.curve == pair
        assert pull.curve_allows(z85.decode(a_key)) and not pull.curve_allows(z85.decode(b_key))
        pub = access_for(cfg, "logjam_pub")
        assert pub.curve_allows(z85.decode(b_key)) and pub.curve_allows(z85.decode(c_public))
        assert not pub.curve_allows(z85.decode(a_key))
        # Adding a key file to the directory lets that client in without a restart.
        (clients / "b.key").write_bytes(Path(b_public).read_bytes())
        assert pull.curve_allows(z85.decode(b_key))
        del b_secret

    @pytest.mark.parametrize(
        ("content", "message"),
        [
            ("nothing here\n", "no secret-key and public-key"),
            ('curve\n    public-key = "abc"\n    secret-key = "def"\n', "40 Z85 characters"),
        ],
    )
    def test_bad_secret_key_files(self, tmp_path: Path, content: str, message: str) -> None:
        path = tmp_path / "hub.key_secret"
        path.write_text(content)
        with pytest.raises(ConfigError, match=message):
            config(f'[access]\ncurve_secret_key_file = "{path}"\n')

    def test_a_public_key_that_is_not_the_secret_keys(self, tmp_path: Path) -> None:
        public, secret = zmq.curve_keypair()
        other, _ = zmq.curve_keypair()
        path = tmp_path / "hub.key_secret"
        path.write_text(
            f'curve\n    public-key = "{other.decode()}"\n    secret-key = "{secret.decode()}"\n'
        )
        with pytest.raises(ConfigError, match="not the secret key's"):
            config(f'[access]\ncurve_secret_key_file = "{path}"\n')
        del public


class TestGate:
    def gate(self, text: str = "", **limits: float) -> tuple[ConnectionGate, Metrics]:
        metrics = Metrics()
        settings = {"max_connections": 10, "max_per_peer": 3, "per_peer_per_s": 1.0}
        settings |= {"per_peer_burst": 5, **limits}
        access = access_for(config(text), "logtk_ws", metrics)
        return ConnectionGate(access, **settings), metrics  # type: ignore[arg-type]

    def test_per_peer_cap_leaves_room_for_others(self) -> None:
        gate, metrics = self.gate()
        assert [gate.admit("10.0.0.1", now=0.0) for _ in range(4)] == [""] * 3 + [
            "max_connections_per_peer"
        ]
        assert gate.admit("10.0.0.2", now=0.0) == ""
        gate.leave("10.0.0.1")
        assert gate.admit("10.0.0.1", now=0.0) == ""
        assert refused(metrics, "logtk_ws", "max_connections_per_peer") == 1
        assert gate.open_connections == 4 and gate.per_peer == {"10.0.0.1": 3, "10.0.0.2": 1}

    def test_rate_per_peer_refills(self) -> None:
        gate, metrics = self.gate(max_per_peer=100)
        results = []
        for _ in range(7):
            results.append(gate.admit("10.0.0.1", now=0.0))
            if not results[-1]:
                gate.leave("10.0.0.1")
        assert results == [""] * 5 + ["peer_connection_rate"] * 2
        assert gate.admit("10.0.0.2", now=0.0) == ""  # another address has its own bucket
        assert gate.admit("10.0.0.1", now=0.5) == "peer_connection_rate"
        assert gate.admit("10.0.0.1", now=1.6) == ""  # one token a second
        assert refused(metrics, "logtk_ws", "peer_connection_rate") == 3

    def test_total_and_allowlist(self) -> None:
        gate, metrics = self.gate('[access]\nallow = ["10.0.0.0/24"]\n', max_connections=2)
        assert gate.admit("10.0.1.1", now=0.0) == "address_not_allowed"
        assert gate.admit("10.0.0.1", now=0.0) == gate.admit("10.0.0.2", now=0.0) == ""
        assert gate.admit("10.0.0.3", now=0.0) == "max_connections"
        assert refused(metrics, "logtk_ws", "address_not_allowed") == 1
        assert refused(metrics, "logtk_ws", "max_connections") == 1

    def test_refusals_are_logged_with_the_peer_then_summarised(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        cfg = config("[access]\nrefusal_log_burst = 2\nrefusal_log_per_s = 0.01\n")
        access = access_for(cfg, "logjam_pull", Metrics())
        with caplog.at_level(logging.WARNING, logger="taproom.access"):
            for i in range(5):
                access.refused(f"10.0.0.{i}", "address_not_allowed")
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [
            "logjam_pull: refused 10.0.0.0: address_not_allowed",
            "logjam_pull: refused 10.0.0.1: address_not_allowed",
        ]


class TestExposure:
    @pytest.mark.parametrize(
        ("section", "listeners"),
        [
            ("web", "web"),
            ("lumberjack", "lumberjack"),
            ("logjam", "logjam_router, logjam_pull, logjam_pub, logjam_replay"),
            ("eventbus", "eventbus_snapshot, eventbus_publisher, eventbus_collector"),
            ("lager", "lager_registrar_snapshot"),
        ],
    )
    def test_exposed_without_control_is_refused(self, section: str, listeners: str) -> None:
        text = f'[{section}]\nenabled = true\nhost = "0.0.0.0"\n'
        with pytest.raises(ConfigError) as caught:
            config(text)
        assert caught.value.key == f"{section}.host" and caught.value.line == 3
        assert listeners in str(caught.value) and "open = true" in str(caught.value)
        assert "allow" in str(caught.value)

    @pytest.mark.parametrize(
        "extra",
        [
            "[access]\nopen = true\n",
            '[access]\nallow = ["10.0.0.0/8"]\n',
            '[access.logjam]\nallow = ["10.0.0.0/8"]\n',
        ],
    )
    def test_allow_or_open_fix_it(self, extra: str) -> None:
        config('[logjam]\nhost = "0.0.0.0"\n' + extra)

    def test_one_listener_left_out_is_named(self) -> None:
        with pytest.raises(ConfigError) as caught:
            config(
                '[logjam]\nhost = "0.0.0.0"\n[access.logjam]\nallow = ["10.0.0.0/8"]\n'
                "[access.logjam_pub]\nallow = []\n"
            )
        assert "listener logjam_pub has" in str(caught.value)

    def test_protocol_controls_count(self, tmp_path: Path) -> None:
        config('[web]\nhost = "0.0.0.0"\ntoken = "t"\n')
        config('[logtk]\nhost = "0.0.0.0"\n')  # every LogTK connection needs an app token
        public, secret = zmq.auth.create_certificates(str(tmp_path), "c")
        config(
            f'[lager]\nenabled = true\nhost = "0.0.0.0"\n[access.lager]\n'
            f'curve_secret_key_file = "{secret}"\ncurve_allowed_clients = ["{public}"]\n'
        )
        with pytest.raises(ConfigError, match="lager_registrar_snapshot"):
            # CURVE without a list of clients encrypts but lets any key in.
            config(
                f'[lager]\nenabled = true\nhost = "0.0.0.0"\n[access.lager]\n'
                f'curve_secret_key_file = "{secret}"\n'
            )

    def test_disabled_sections_and_loopback_are_fine(self) -> None:
        config('[lager]\nenabled = false\nhost = "0.0.0.0"\n')
        config('[lager]\nenabled = true\nhost = "::1"\n')
        config('[eventbus]\nenabled = true\nhost = "localhost"\n')

    def test_open_listeners(self) -> None:
        cfg = config(
            '[logjam]\nhost = "0.0.0.0"\n[access.logjam]\nopen = true\n'
            '[access.logjam_pull]\nallow = ["10.0.0.0/8"]\n'
        )
        assert open_listeners(cfg) == [
            "logjam_router (0.0.0.0)",
            "logjam_pub (0.0.0.0)",
            "logjam_replay (0.0.0.0)",
        ]


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "taproom", "validate", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("section", "listener"),
    [
        ("web", "web"),
        ("lumberjack", "lumberjack"),
        ("logjam", "logjam_pull"),
        ("eventbus", "eventbus_collector"),
        ("lager", "lager_forwarder_in"),
    ],
)
def test_validate_exposed_configs(tmp_path: Path, section: str, listener: str) -> None:
    """Issue 27: 0.0.0.0 with no access control exits 78 naming the listener; open = true
    exits 0 with one warning."""
    path = tmp_path / "taproom.toml"
    path.write_text(f'[{section}]\nenabled = true\nhost = "0.0.0.0"\n')
    done = _validate(path)
    assert done.returncode == 78, done.stderr
    assert listener in done.stderr and f"{path}:3: {section}.host" in done.stderr
    path.write_text(
        f'[{section}]\nenabled = true\nhost = "0.0.0.0"\n[access.{section}]\nopen = true\n'
    )
    done = _validate(path)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1 and listener in warnings[0] and "open = true" in warnings[0]


async def test_serve_warns_once_about_open_listeners(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`serve` (App.start) logs one WARNING naming every listener `open = true` lets through;
    no listener is started here (only=[]), so nothing binds 0.0.0.0 in a test."""
    from taproom.app import App

    cfg = config(
        f'[journal]\ndir = "{tmp_path / "journal"}"\n'
        '[logjam]\nhost = "0.0.0.0"\n[lager]\nenabled = true\nhost = "0.0.0.0"\n'
        '[access]\nopen = true\n[access.lager]\nallow = ["10.0.0.0/8"]\n'
    )
    with caplog.at_level(logging.WARNING, logger="taproom"):
        app = App(cfg, only=[])
        await app.start()
        await app.stop()
    lines = [r.getMessage() for r in caplog.records if "open = true" in r.getMessage()]
    assert len(lines) == 1 and "logjam_router (0.0.0.0)" in lines[0]
    assert "lager" not in lines[0]


def test_serve_refuses_an_exposed_listener(tmp_path: Path) -> None:
    path = tmp_path / "taproom.toml"
    path.write_text(f'[journal]\ndir = "{tmp_path / "j"}"\n[logjam]\nhost = "0.0.0.0"\n')
    done = subprocess.run(
        [sys.executable, "-m", "taproom", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 78 and "logjam_pull" in done.stderr
    assert not (tmp_path / "j").exists()  # refused before anything was opened
