"""Decodes what an edge-outbox relay publishes with cbor2, a CBOR library that knows nothing of
the crate: an envelope (version 1 or 2), a gap notice, or a batch (version 3) of envelopes, plain
or compressed with zlib (Python's standard library).

Usage: wire_decode.py HEX

For a batch: first `batch N plain` or `batch N zlib`, then each envelope's lines as below, each
envelope's block starting with `--`.

Checks the types the CDDL in docs/wire-format.md promises and prints one line per field:
`keys` (in wire order), then `v`, `id` (hex), `src`, `ep`, `seq`, `key`, `ts`, `type`, `hdr` and
`p` (the last two as compact JSON with sorted keys; `p` is decoded as a native value, not bytes).
For a gap notice: `keys`, `v`, `id`, `src`, `ep`, `ts`, then `gap FIRST LAST CAUSE WHY`.
"""

import json
import sys
import zlib

import cbor2


def main(hex_bytes: str) -> None:
    raw = bytes.fromhex(hex_bytes)
    env = cbor2.loads(raw)
    # A definite-length map head (major type 5, fewer than 24 pairs in the head byte itself).
    assert raw[0] >> 5 == 5 and raw[0] & 0x1F < 24, f"envelope head 0x{raw[0]:02x}"
    if isinstance(env, dict) and env.get("v") == 3:
        batch(env)
        return
    envelope(env)


def batch(b: dict) -> None:
    assert set(b) in ({"v", "batch"}, {"v", "zlib"}), list(b)
    if "zlib" in b:
        assert type(b["zlib"]) is bytes
        items = cbor2.loads(zlib.decompress(b["zlib"]))
        how = "zlib"
    else:
        items = b["batch"]
        how = "plain"
    assert isinstance(items, list) and len(items) > 0, items
    print("batch", len(items), how)
    for env in items:
        print("--")
        assert env.get("v") == 2, "each message of a batch is a version 2 envelope"
        envelope(env)


def envelope(env: dict) -> None:
    assert isinstance(env, dict), f"envelope is a {type(env)}"
    assert all(isinstance(k, str) for k in env), "envelope keys are text"
    assert type(env["v"]) is int and env["v"] in (1, 2), env["v"]
    assert type(env["id"]) is bytes and len(env["id"]) == 16, env["id"]
    assert type(env["src"]) is str
    if env["v"] == 2:
        assert type(env["ep"]) is int and 0 < env["ep"] < 2**63, env["ep"]
    else:
        assert "ep" not in env
    if "gap" in env:
        gap_notice(env)
        return
    assert type(env["seq"]) is int and env["seq"] >= 0
    assert type(env["key"]) is str
    assert type(env["ts"]) is int and env["ts"] >= 0
    if "type" in env:
        assert type(env["type"]) is str
    if "hdr" in env:
        assert all(type(k) is str and type(v) is str for k, v in env["hdr"].items())

    compact = {"sort_keys": True, "separators": (",", ":")}
    print("keys", ",".join(env.keys()))
    print("v", env["v"])
    print("id", env["id"].hex())
    print("src", env["src"])
    print("ep", env.get("ep"))
    print("seq", env["seq"])
    print("key", env["key"])
    print("ts", env["ts"])
    print("type", env.get("type"))
    print("hdr", json.dumps(env.get("hdr"), **compact))
    print("p", json.dumps(env["p"], **compact))


def gap_notice(env: dict) -> None:
    assert env["v"] == 2 and "p" not in env, env
    assert type(env["ts"]) is int and env["ts"] >= 0
    gap = env["gap"]
    assert isinstance(gap, dict) and all(isinstance(k, str) for k in gap)
    assert type(gap["first"]) is int and type(gap["last"]) is int
    assert 0 < gap["first"] <= gap["last"], gap
    assert gap["cause"] in ("evicted", "expired", "dead-lettered", "purged", "unrecoverable"), gap
    if "why" in gap:
        assert type(gap["why"]) is str
    print("keys", ",".join(env.keys()))
    print("v", env["v"])
    print("id", env["id"].hex())
    print("src", env["src"])
    print("ep", env["ep"])
    print("ts", env["ts"])
    print("gap", gap["first"], gap["last"], gap["cause"], gap.get("why"))


if __name__ == "__main__":
    main(sys.argv[1])
