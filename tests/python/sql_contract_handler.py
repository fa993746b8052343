"""A foreign command handler following the inbox apply contract of docs/schema.md.

Usage: sql_contract_handler.py DB

Applies at most one command: in one BEGIN IMMEDIATE transaction it picks the oldest due command
that has no older unapplied command of its key, credits `account.balance` with the payload (a
CBOR integer), publishes a reply through the outbox, and marks the command applied with an UPDATE
that must change exactly one row (otherwise it rolls everything back). Prints "applied <hex id>",
"none" or "lost".
"""

import sqlite3
import sys

import cbor2

NOW_MS = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

NEXT_DUE = f"""
SELECT seq, id, key, payload FROM inbox AS i
WHERE applied_at IS NULL AND dead_at IS NULL AND next_attempt_at <= {NOW_MS}
  AND NOT EXISTS (SELECT 1 FROM inbox AS o
                  WHERE o.key = i.key AND o.seq < i.seq
                    AND o.applied_at IS NULL AND o.dead_at IS NULL)
ORDER BY seq LIMIT 1
"""


def main(db: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 10000")
    conn.execute("BEGIN IMMEDIATE")
    row = conn.execute(NEXT_DUE).fetchone()
    if row is None:
        conn.execute("COMMIT")
        print("none")
        return
    seq, msg_id, key, payload = row
    amount = cbor2.loads(payload)
    conn.execute("UPDATE account SET balance = balance + ?", (amount,))
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("replies/credit", key, cbor2.dumps({"credited": amount, "command": msg_id})),
    )
    marked = conn.execute(
        f"UPDATE inbox SET applied_at = {NOW_MS}, payload = NULL"
        " WHERE seq = ? AND applied_at IS NULL AND dead_at IS NULL",
        (seq,),
    ).rowcount
    if marked != 1:
        conn.execute("ROLLBACK")
        print("lost")
        return
    conn.execute("COMMIT")
    print("applied", msg_id.hex())


if __name__ == "__main__":
    main(sys.argv[1])
