"""Decodes an edge-outbox envelope with cbor2, a CBOR library that knows nothing of the crate.

Usage: wire_decode.py HEX

Checks the types the CDDL in docs/wire-format.md promises and prints one line per field:
`keys` (in wire order), then `v`, `id` (hex), `src`, `seq`, `key`, `ts`, `type`, `hdr` and `p`
(the last two as compact JSON with sorted keys; `p` is decoded as a native value, not bytes).
"""

import json
import sys

import cbor2


def main(hex_bytes: str) -> None:
    raw = bytes.fromhex(hex_bytes)
    env = cbor2.loads(raw)
    assert isinstance(env, dict), f"envelope is a {type(env)}"
    assert all(isinstance(k, str) for k in env), "envelope keys are text"
    assert type(env["v"]) is int and env["v"] == 1, env["v"]
    assert type(env["id"]) is bytes and len(env["id"]) == 16, env["id"]
    assert type(env["src"]) is str
    assert type(env["seq"]) is int and env["seq"] >= 0
    assert type(env["key"]) is str
    assert type(env["ts"]) is int and env["ts"] >= 0
    if "type" in env:
        assert type(env["type"]) is str
    if "hdr" in env:
        assert all(type(k) is str and type(v) is str for k, v in env["hdr"].items())
    # A definite-length map head (major type 5, fewer than 24 pairs in the head byte itself).
    assert raw[0] >> 5 == 5 and raw[0] & 0x1F < 24, f"envelope head 0x{raw[0]:02x}"

    compact = {"sort_keys": True, "separators": (",", ":")}
    print("keys", ",".join(env.keys()))
    print("v", env["v"])
    print("id", env["id"].hex())
    print("src", env["src"])
    print("seq", env["seq"])
    print("key", env["key"])
    print("ts", env["ts"])
    print("type", env.get("type"))
    print("hdr", json.dumps(env.get("hdr"), **compact))
    print("p", json.dumps(env["p"], **compact))


if __name__ == "__main__":
    main(sys.argv[1])
