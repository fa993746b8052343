"""An application's virtual tables (and a WITHOUT ROWID table) in the shared file, made and queried with Python's own SQLite,
which has FTS5 and R*Tree (the CLI's has neither).

    salvage_virtual_tables.py create DB   adds a full-text table and an R*Tree, with rows
    salvage_virtual_tables.py check DB    prints what their queries find, one line each
"""

import sqlite3
import sys

NOTES = ["pump 3 vibrates", "valve 7 sticks", "pump 9 is quiet", "fan 2 rattles"]


def create(db):
    conn = sqlite3.connect(db)
    conn.execute("CREATE VIRTUAL TABLE notes USING fts5(body)")
    conn.executemany("INSERT INTO notes (body) VALUES (?)", [(n,) for n in NOTES])
    conn.execute("CREATE VIRTUAL TABLE zones USING rtree(id, min_x, max_x, min_y, max_y)")
    conn.executemany(
        "INSERT INTO zones VALUES (?, ?, ?, ?, ?)",
        [(i, i, i + 1.0, 0.0, 1.0) for i in range(1, 101)],
    )
    conn.execute("CREATE TABLE settings (name TEXT PRIMARY KEY, value) WITHOUT ROWID")
    conn.executemany("INSERT INTO settings VALUES (?, ?)", [(f"s{i}", i) for i in range(50)])
    conn.commit()
    conn.close()


def check(db):
    conn = sqlite3.connect(db)
    pumps = conn.execute(
        "SELECT body FROM notes WHERE notes MATCH 'pump' ORDER BY rowid"
    ).fetchall()
    print("notes matching pump:", "; ".join(b for (b,) in pumps))
    inside = conn.execute(
        "SELECT count(*) FROM zones WHERE min_x >= 10 AND max_x <= 20"
    ).fetchone()[0]
    print("zones inside 10..20:", inside)
    print("settings:", conn.execute("SELECT count(*), sum(value) FROM settings").fetchone())
    # Each module's own check of its shadow tables, then the file's.
    conn.execute("INSERT INTO notes (notes) VALUES ('integrity-check')")
    print("rtree check:", conn.execute("SELECT rtreecheck('zones')").fetchone()[0])
    print("integrity:", conn.execute("PRAGMA integrity_check").fetchone()[0])
    conn.close()


if __name__ == "__main__":
    {"create": create, "check": check}[sys.argv[1]](sys.argv[2])
