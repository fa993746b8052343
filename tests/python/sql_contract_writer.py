"""A foreign writer following the SQL contract of docs/schema.md.

Usage: sql_contract_writer.py DB

Inserts a business row and four outbox rows (three CBOR payloads as BLOB, one TEXT payload) in
one transaction that commits, then one row in a transaction that rolls back. Only the columns
topic, key and payload are written: the id, seq and created_at come from the column defaults, which
must work in the system SQLite that Python links (Debian 12: 3.40). Prints the SQLite version.
"""

import sqlite3
import sys

import cbor2


def main(db: str) -> None:
    # isolation_level=None: no implicit transactions; we say BEGIN/COMMIT ourselves.
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 10000")

    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO readings (probe, celsius) VALUES ('probe-1', 21.5)")
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("sensors/temp", "probe-1", cbor2.dumps({"probe": "probe-1", "celsius": 21.5})),
    )
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("sensors/temp", "probe-2", cbor2.dumps([1, 2, 3])),
    )
    # No key: the default '' applies.
    conn.execute(
        "INSERT INTO outbox (topic, payload) VALUES (?, ?)",
        ("alerts", cbor2.dumps("overheat")),
    )
    # A TEXT payload: the relay sends it as a CBOR text string.
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('logs', 'probe-1', 'plain text line')"
    )
    conn.execute("COMMIT")

    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("rolled/back", "k", cbor2.dumps("never published")),
    )
    conn.execute("ROLLBACK")
    conn.close()
    print(sqlite3.sqlite_version)


if __name__ == "__main__":
    main(sys.argv[1])
