//! A build without the `schemas` feature on a file that has payload schemas: it cannot check
//! them, so it says so once per open instead of publishing unchecked rows silently.

use rusqlite::Connection;

pub(crate) fn warn_if_any(conn: &Connection) {
    let count: rusqlite::Result<i64> =
        conn.query_row("SELECT count(*) FROM edge_outbox_schemas", [], |r| r.get(0));
    if let Ok(n) = count
        && n > 0
    {
        tracing::warn!(
            schemas = n,
            "this file has payload schemas, but this build of edge-outbox lacks the `schemas` \
             feature: payloads written or published through it are not checked"
        );
    }
}
