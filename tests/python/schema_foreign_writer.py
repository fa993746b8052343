"""A foreign writer that knows nothing of the payload schemas: it commits one order that follows
the schema of docs/schemas.md's example and one that does not (its id is a number), through the
SQL contract. SQLite cannot refuse the second at its commit; the relay must.

Usage: schema_foreign_writer.py DB
"""

import sqlite3
import sys

import cbor2


def main(db: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 10000")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("orders/placed", "o-py-1", cbor2.dumps({"id": "o-py-1", "total": 12})),
    )
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("orders/placed", "o-py-2", cbor2.dumps({"id": 2, "total": 12})),
    )
    conn.execute("COMMIT")
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
