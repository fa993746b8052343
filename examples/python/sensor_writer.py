#!/usr/bin/env python3
"""A non-Rust writer: Python's sqlite3 enqueues through the SQL contract, `edge-outbox relay`
publishes. The reading and its event commit in one transaction, like any outbox.

    edge-outbox relay --db /tmp/sensor.db --broker mqtt://127.0.0.1:1883 --client-id sensor-1 &
    python3 examples/python/sensor_writer.py /tmp/sensor.db 100

Payloads must be one CBOR item (BLOB); with `cbor2` installed they are, otherwise a TEXT payload
is published as a CBOR text string. The file must have been opened once by edge-outbox (the relay
does), which creates the tables.
"""
import sqlite3
import sys
import time

try:
    import cbor2

    def payload(value):
        return cbor2.dumps(value)
except ImportError:  # TEXT payloads go out as CBOR text strings
    def payload(value):
        return str(value)


def main():
    db = sys.argv[1] if len(sys.argv) > 1 else "sensor.db"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    conn = sqlite3.connect(db, isolation_level=None, timeout=10)
    conn.execute("PRAGMA synchronous = FULL")  # a returned commit survives a power cut
    conn.execute("CREATE TABLE IF NOT EXISTS readings (n INTEGER PRIMARY KEY, celsius REAL)")
    for n in range(start, start + count):
        celsius = 20.0 + (n % 10) / 10
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO readings VALUES (?, ?)", (n, celsius))
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
            ("sensors/python/temperature", "probe-%d" % (n % 3), payload({"n": n, "celsius": celsius})),
        )
        conn.execute("COMMIT")
        print("committed", n, flush=True)
        time.sleep(0.001)


if __name__ == "__main__":
    main()
