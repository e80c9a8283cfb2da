"""The ``[lager]`` configuration section: ports, limits and timers of the Bartender."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import config_section, setting

__all__ = ["FORWARDER_FOLLOWS_REGISTRAR", "FORWARDER_OFFSET", "LagerConfig"]

# nasa/lager's lager_defines.h: FORWARDER_FRONTEND_OFFSET = 10, FORWARDER_BACKEND_OFFSET = 11.
FORWARDER_OFFSET = 10
FORWARDER_FOLLOWS_REGISTRAR = -1


@config_section(
    "lager",
    retired={
        "collector_hwm": "the registrar collector is read by taproom's own ZMTP transport: "
        "bounded in bytes by the memory budget's connection_buffers and [zmtp]",
        "input_hwm": "the forwarder input is read by taproom's own ZMTP transport: "
        "bounded in bytes by the memory budget's connection_buffers and [zmtp]",
    },
)
@dataclass(frozen=True)
class LagerConfig:
    enabled: bool = setting(True, "robot telemetry taps and mugs")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    registrar_port: int = setting(
        12345,
        "nasa/lager's base port: CHP SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2",
        min=0,
        max=65523,
    )
    forwarder_port: int = setting(
        FORWARDER_FOLLOWS_REGISTRAR,
        "-1: registrar port + 10, as nasa/lager (taps publish to F, mugs subscribe at F+1); "
        "taproom's counted output for its own mugs (data, loss marks, hello) is at F+2",
        min=-1,
        max=65533,
    )
    hugz_interval_s: float = setting(
        1.0, "seed: 'a HUGZ message at an interval of 1Hz' when no update was sent", min=0.01
    )
    max_taps: int = setting(
        100_000, "hashmap entries; a fleet of robots is thousands, not millions", min=1
    )
    max_key_bytes: int = setting(255, "a tap key is a short name", min=8, max=65535)
    max_format_bytes: int = setting(
        64 * 1024, "a BEERR01 format of ~1000 items fits; bounds XML parsing work", min=256
    )
    max_format_items: int = setting(1024, "items per row; rows are telemetry, not blobs", min=1)
    max_registration_frame_bytes: int = setting(
        256 * 1024,
        "a registration up to this (plus a key and 4 KiB of other frames) reaches the "
        "registrar, which refuses and counts an oversized format (xml_too_large) and keeps the "
        "tap's connection; a bigger message disconnects the tap (message_too_large; taken as "
        "at least max_format_bytes + max_key_bytes)",
        min=1024,
    )
    max_payload_bytes: int = setting(
        1024 * 1024,
        "one row; a data message may take this plus its frames' framing and 4 KiB of header "
        "frames on the forwarder input (a bigger one disconnects the tap: message_too_large)",
        min=64,
    )
    max_message_frames: int = setting(
        1028, "5 frames per seed message; C++ taps send one frame per item (4 + items)", min=5
    )
    max_batch_messages: int = setting(
        8192, "data messages drained into one journal batch before yielding the loop", min=1
    )
    burst_bytes: int = setting(
        8 * 1024 * 1024,
        "bytes of rows one read of the forwarder input takes before its batch goes to the "
        "journal (a burst is read into one buffer): rows are KBs",
        min=64 * 1024,
        max=1 << 30,
    )
    forward_hwm: int = setting(
        100_000,
        "messages queued per mug before ZeroMQ drops for that slow mug only (counted by the "
        "mug through marks); 100k 5-frame rows of 32 B is ~30 MB per stuck mug",
        min=1,
    )
    mark_repeat: int = setting(
        60,
        "HUGZ rounds a tap's loss mark is repeated after its last row, so a mug that was "
        "behind (its marks dropped with the rows) still learns the final count",
        min=1,
    )
    takeover_after_s: float = setting(
        5.0,
        "a tap is gone when nothing (rows, registrations) came from its uuid this long; then a "
        "registration naming a new uuid may take its key (nasa/lager's Tap makes a new uuid at "
        "every start)",
        min=0.01,
    )
    unknown_tap_hold_s: float = setting(
        1.0,
        "rows from a uuid no registration names wait this long for one before they are "
        "journaled unattributed: a real Tap's registration leaves with its first rows (its CHP "
        "client sends every 100 ms), so rows that overtook it still land under its key, and a "
        "restarted Tap that never registers again delays its mugs only this long",
        min=0.0,
    )
    max_held_bytes: int = setting(
        16 * 1024 * 1024,
        "rows held for unregistered uuids, all together (past it the oldest holds end early, "
        "unattributed): 16 fleets of 1,000 taps of 1 KiB rows at 1 Hz for 1 s",
        min=0,
    )
    checkpoint_interval_s: float = setting(
        1.0, "registrar checkpoint at most this often; the journal covers the rest", min=0.01
    )
    state_file: str = setting(
        "", "registrar checkpoint; empty means <journal dir>/lager-registrar.json"
    )
    port_retries: int = setting(50, "port 0: tries to find consecutive free ports", min=1)
