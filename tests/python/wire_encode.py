"""Encodes an edge-outbox envelope with cbor2 from a plain dict, as a non-Rust sender would.

Usage: wire_encode.py ID_HEX

Keys are in an order of Python's choosing, there is a key this version of the format does not
define (decoders must ignore it), and the payload is a native value. Prints the envelope as hex.
"""

import sys

import cbor2


def main(id_hex: str) -> None:
    envelope = {
        "p": {"amount": 1250, "currency": "EUR", "lines": ["a", "b"], "rush": False, "note": None},
        "future-field": {"added": "in a later version"},
        "key": "account-7",
        "id": bytes.fromhex(id_hex),
        "v": 1,
        "src": "python-sender",
        "seq": 2**40 + 3,
        "ts": 1_767_225_600_123,
        "type": "Credit.v2",
        "hdr": {"trace-id": "4bf92f3577b34da6", "schema": "2"},
    }
    print(cbor2.dumps(envelope).hex())


if __name__ == "__main__":
    main(sys.argv[1])
