"""The statements of the SQL contract (docs/schema.md, "Writing from another process"), each run
the way a foreign writer would: Python's standard sqlite3 module on the system SQLite.

Usage: sql_contract_statements.py DB STATEMENT [ARG]

Prints what the statement gave, one `name value` line each, for tests/sql_contract_statements.rs.
"""

import sqlite3
import sys
import time
import uuid

import cbor2

REQUIRED_SCHEMA = 5  # expires_at, epochs and the UUIDv4 id default


def connect(db: str) -> sqlite3.Connection:
    conn = sqlite3.connect(db, isolation_level=None)  # explicit transactions only
    conn.execute("PRAGMA busy_timeout = 10000")
    return conn


def ready(conn: sqlite3.Connection) -> None:
    # The documented readiness check: the schema exists and is at least the version we know.
    try:
        (version,) = conn.execute(
            "SELECT value FROM edge_outbox_meta WHERE name = 'schema_version'"
        ).fetchone()
    except sqlite3.OperationalError as e:  # no such table: edge-outbox never opened this file
        print("not-ready", e)
        return
    print("ready" if version >= REQUIRED_SCHEMA else "too-old", version)


def returning(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")
    seq, id_ = conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?) RETURNING seq, id",
        ("contract/returning", "k", cbor2.dumps("returned")),
    ).fetchone()
    # The message's number on the wire: in the epoch that covers this row, counted from 1.
    epoch, wire_seq = conn.execute(
        "SELECT epoch, ?1 - first_seq + 1 FROM edge_outbox_epochs WHERE first_seq <= ?1 "
        "ORDER BY first_seq DESC LIMIT 1",
        (seq,),
    ).fetchone()
    conn.execute("COMMIT")
    # Before 3.35 (no RETURNING): the rowid of the last insert is the seq.
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES (?, ?, ?)",
        ("contract/returning", "k", cbor2.dumps("by rowid")),
    )
    (rowid,) = conn.execute("SELECT last_insert_rowid()").fetchone()
    (id2,) = conn.execute("SELECT id FROM outbox WHERE seq = ?", (rowid,)).fetchone()
    conn.execute("COMMIT")
    print("seq", seq)
    print("id", bytes(id_).hex())
    print("epoch", epoch)
    print("wire_seq", wire_seq)
    print("rowid_seq", rowid)
    print("rowid_id", bytes(id2).hex())


def own_id(conn: sqlite3.Connection, id_hex: str) -> None:
    own = bytes.fromhex(id_hex)
    for text in ("first", "again"):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO outbox (id, topic, key, payload) VALUES (?, ?, ?, ?)",
            (own, "contract/own-id", "k", cbor2.dumps(text)),
        )
        conn.execute("COMMIT")
    # An id that is not 16 bytes is refused by the table itself; nothing is written.
    for bad in (uuid.UUID(id_hex).hex.encode(), own[:8]):
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "INSERT INTO outbox (id, topic, key, payload) VALUES (?, ?, ?, ?)",
                (bad, "contract/own-id", "k", cbor2.dumps("bad id")),
            )
            conn.execute("COMMIT")
            print("accepted", len(bad))
        except sqlite3.IntegrityError as e:
            conn.execute("ROLLBACK")
            print("refused", len(bad), e)


def default_ids(conn: sqlite3.Connection, n: str) -> None:
    conn.execute("BEGIN IMMEDIATE")
    for i in range(int(n)):
        (id_,) = conn.execute(
            "INSERT INTO outbox (topic, payload) VALUES ('contract/ids', ?) RETURNING id",
            (cbor2.dumps(i),),
        ).fetchone()
        u = uuid.UUID(bytes=bytes(id_))
        print("id", u.hex, u.version, "rfc4122" if u.variant == uuid.RFC_4122 else u.variant)
    conn.execute("COMMIT")


def ts(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")
    before = time.time_ns() // 1_000_000
    (seq,) = conn.execute(
        "INSERT INTO outbox (topic, payload) VALUES ('contract/ts', ?) RETURNING seq",
        (cbor2.dumps("when"),),
    ).fetchone()
    after_insert = time.time_ns() // 1_000_000
    time.sleep(0.05)  # the transaction stays open: the commit comes later
    before_commit = time.time_ns() // 1_000_000
    conn.execute("COMMIT")
    print("seq", seq)
    print("before_insert", before)
    print("after_insert", after_insert)
    print("before_commit", before_commit)


def gapless(conn: sqlite3.Connection) -> None:
    def insert(text: str) -> int:
        (seq,) = conn.execute(
            "INSERT INTO outbox (topic, payload) VALUES ('contract/gapless', ?) RETURNING seq",
            (cbor2.dumps(text),),
        ).fetchone()
        return seq

    committed = [insert("autocommit")]
    # A transaction that rolls back, with several inserts.
    conn.execute("BEGIN IMMEDIATE")
    insert("rolled back 1")
    insert("rolled back 2")
    conn.execute("ROLLBACK")
    # A statement that fails inside a transaction that then commits.
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("INSERT INTO outbox (topic, payload) VALUES ('', x'01')")  # CHECK: empty topic
    except sqlite3.IntegrityError:
        pass
    committed.append(insert("after a failed statement"))
    # A savepoint rolled back inside a transaction that commits.
    conn.execute("SAVEPOINT inner")
    insert("in a rolled-back savepoint")
    conn.execute("ROLLBACK TO inner")
    conn.execute("RELEASE inner")
    committed.append(insert("after the savepoint"))
    conn.execute("COMMIT")
    # A crash mid-transaction: the connection goes away with the transaction open.
    conn.execute("BEGIN IMMEDIATE")
    insert("never committed")
    conn.close()
    conn = connect(sys.argv[1])
    committed.append(insert("after a connection died mid-transaction"))
    print("committed", " ".join(map(str, committed)))


def main(db: str, statement: str, *args: str) -> None:
    conn = connect(db)
    {
        "ready": ready,
        "returning": returning,
        "own-id": own_id,
        "default-ids": default_ids,
        "ts": ts,
        "gapless": gapless,
    }[statement](conn, *args)


if __name__ == "__main__":
    main(*sys.argv[1:])
