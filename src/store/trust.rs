//! The command signature policy, stored in the file (schema version 7).
//!
//! A device that requires signed commands records that fact, its validity window and the keys it
//! trusts in its own database. Every receive verifies against what the file says, whatever the
//! handle doing it was configured with: a keyless handle (the CLI's `dead-letters retry`, a second
//! `Outbox::open`) is held to the same rule as the device's own. A trigger refuses plain-SQL
//! inserts of unverified commands. The policy changes only through [`require`] and [`stop`],
//! each of which leaves a row in `edge_outbox_command_policy_log`.

use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};

use crate::error::Result;

/// What the file requires of commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Policy {
    /// Trusted key ids and their Ed25519 public keys, ordered by key id.
    pub keys: Vec<(String, [u8; 32])>,
    pub max_age: Duration,
    pub clock_skew: Duration,
    /// When the device started requiring signatures, Unix ms.
    pub required_since: i64,
}

impl Policy {
    /// How long after it was accepted a replay of a signed command can still verify: its id must
    /// be remembered at least this long.
    pub(crate) fn replay_window(&self) -> Duration {
        self.max_age.saturating_add(self.clock_skew)
    }

    /// The trusted key ids, for messages.
    pub(crate) fn key_ids(&self) -> String {
        let ids: Vec<&str> = self.keys.iter().map(|(id, _)| id.as_str()).collect();
        ids.join(", ")
    }
}

/// The policy a file records for `keys` (ordered by key id, so equal sets compare equal).
#[cfg(feature = "signed-commands")]
pub(crate) fn policy_of(keys: &crate::signed::TrustedKeys) -> Policy {
    let (entries, max_age, clock_skew) = keys.parts();
    let mut keys = entries.to_vec();
    keys.sort();
    Policy {
        keys,
        max_age,
        clock_skew,
        required_since: crate::time::now_ms(),
    }
}

/// The keys a file's policy trusts, to verify with.
#[cfg(feature = "signed-commands")]
pub(crate) fn keys_of(policy: &Policy) -> crate::signed::TrustedKeys {
    crate::signed::TrustedKeys::from_parts(policy.keys.clone(), policy.max_age, policy.clock_skew)
}

/// The file's policy: `None` when commands need no signature.
pub(crate) fn load(conn: &Connection) -> Result<Option<Policy>> {
    let window: Option<(i64, i64, i64)> = conn
        .prepare_cached(
            "SELECT max_age_ms, clock_skew_ms, required_since FROM edge_outbox_command_policy WHERE only = 1",
        )?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?;
    let Some((max_age, skew, required_since)) = window else {
        return Ok(None);
    };
    let mut stmt =
        conn.prepare_cached("SELECT key_id, public_key FROM edge_outbox_command_keys ORDER BY key_id")?;
    let keys = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?)))?
        .filter_map(|row| match row {
            // The table's CHECK keeps every key 32 bytes long; a row that is not is no key.
            Ok((id, key)) => <[u8; 32]>::try_from(key.as_slice()).ok().map(|k| Ok((id, k))),
            Err(e) => Some(Err(e)),
        })
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
    Ok(Some(Policy {
        keys,
        max_age: ms(max_age),
        clock_skew: ms(skew),
        required_since,
    }))
}

/// Requires signed commands from now on, trusting exactly `keys` within the window given, and
/// logs the change with `why`. Run inside the caller's write transaction. Returns whether the
/// policy changed (false: it already was exactly this).
#[cfg(feature = "signed-commands")]
pub(crate) fn require(conn: &Connection, wanted: &Policy, why: &str) -> Result<bool> {
    let before = load(conn)?;
    if before.as_ref().is_some_and(|p| same_rule(p, wanted)) {
        return Ok(false);
    }
    let now = crate::time::now_ms();
    conn.execute(
        "INSERT INTO edge_outbox_command_policy (only, max_age_ms, clock_skew_ms, required_since)
         VALUES (1, ?1, ?2, ?3)
         ON CONFLICT (only) DO UPDATE SET max_age_ms = excluded.max_age_ms, clock_skew_ms = excluded.clock_skew_ms",
        rusqlite::params![
            i64::try_from(wanted.max_age.as_millis()).unwrap_or(i64::MAX),
            i64::try_from(wanted.clock_skew.as_millis()).unwrap_or(i64::MAX),
            now
        ],
    )?;
    conn.execute("DELETE FROM edge_outbox_command_keys", [])?;
    for (id, key) in &wanted.keys {
        conn.execute(
            "INSERT INTO edge_outbox_command_keys (key_id, public_key, trusted_at) VALUES (?1, ?2, ?3)",
            rusqlite::params![id, key.as_slice(), now],
        )?;
    }
    let change = match &before {
        None => format!(
            "signed commands required ({why}): keys [{}], max age {:?}, clock skew {:?}",
            wanted.key_ids(),
            wanted.max_age,
            wanted.clock_skew
        ),
        Some(old) => format!(
            "trusted command keys changed ({why}): keys [{}] -> [{}], max age {:?} -> {:?}, clock skew {:?} -> {:?}",
            old.key_ids(),
            wanted.key_ids(),
            old.max_age,
            wanted.max_age,
            old.clock_skew,
            wanted.clock_skew
        ),
    };
    log(conn, &change)?;
    Ok(true)
}

/// Stops requiring signed commands, logged with `why`. Returns whether anything changed.
#[cfg(feature = "signed-commands")]
pub(crate) fn stop(conn: &Connection, why: &str) -> Result<bool> {
    let Some(old) = load(conn)? else {
        return Ok(false);
    };
    conn.execute("DELETE FROM edge_outbox_command_keys", [])?;
    conn.execute("DELETE FROM edge_outbox_command_policy", [])?;
    log(
        conn,
        &format!(
            "signed commands no longer required ({why}); keys [{}] no longer trusted",
            old.key_ids()
        ),
    )?;
    Ok(true)
}

/// The same keys and window (the time it was first required does not matter).
#[cfg(feature = "signed-commands")]
pub(crate) fn same_rule(a: &Policy, b: &Policy) -> bool {
    a.keys == b.keys && a.max_age == b.max_age && a.clock_skew == b.clock_skew
}

#[cfg(feature = "signed-commands")]
fn log(conn: &Connection, change: &str) -> Result<()> {
    conn.execute(
        "INSERT INTO edge_outbox_command_policy_log (change) VALUES (?1)",
        [change],
    )?;
    // An operator reading the logs sees every change of who may command the device.
    tracing::warn!(%change, "command signature policy changed");
    Ok(())
}
