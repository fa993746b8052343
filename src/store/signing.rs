//! The explicit, logged operations on a file's command signature policy (feature
//! `signed-commands`; the policy itself is in [`super::trust`]).

use rusqlite::{Connection, TransactionBehavior};

use super::Outbox;
use super::trust;
use crate::error::{Error, Result};
use crate::signed::TrustedKeys;

/// Opening with [`Options::trusted_command_keys`](crate::Options::trusted_command_keys): a file
/// that does not require signatures yet starts requiring them (logged); one that does must trust
/// exactly these keys within the same window, or the open fails: the keys change only through
/// [`Outbox::require_signed_commands`].
pub(crate) fn adopt_on_open(conn: &mut Connection, keys: &TrustedKeys) -> Result<()> {
    let wanted = trust::policy_of(keys);
    // Read first: an open that changes nothing takes no write lock.
    if trust::load(conn)?.is_some_and(|p| trust::same_rule(&p, &wanted)) {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    match trust::load(&tx)? {
        Some(current) if !trust::same_rule(&current, &wanted) => {
            return Err(Error::InvalidConfig(format!(
                "this file trusts command keys [{}] (max age {:?}, clock skew {:?}), not the [{}] \
                 (max age {:?}, clock skew {:?}) these options give: change the file's keys with \
                 Outbox::require_signed_commands, which logs the change",
                current.key_ids(),
                current.max_age,
                current.clock_skew,
                wanted.key_ids(),
                wanted.max_age,
                wanted.clock_skew
            )));
        }
        Some(_) => {}
        None => {
            trust::require(&tx, &wanted, "opened with trusted_command_keys")?;
        }
    }
    tx.commit()?;
    Ok(())
}

impl Outbox {
    /// Requires every command on this file to be signed by one of `keys`, from now on and through
    /// every handle (feature `signed-commands`): a handle opened without keys, the
    /// `edge-outbox` CLI and foreign writers are held to it too. Replaces the keys and window the
    /// file trusted before (key rotation); the change is logged (WARN, and a row in
    /// `edge_outbox_command_policy_log`).
    ///
    /// Fails with [`Error::InvalidConfig`] for keys [`Options::trusted_command_keys`](crate::Options::trusted_command_keys)
    /// would refuse. Handles opened with the old keys in their options keep working (they
    /// verify with the file's keys); opening with them again fails until the options match.
    ///
    /// ```
    /// use edge_outbox::{CommandSigner, Outbox, TrustedKeys};
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// let outbox = Outbox::open(dir.path().join("device.db"))?;
    /// let signer = CommandSigner::from_secret_key("cloud-2027", [3u8; 32]);
    /// outbox.require_signed_commands(TrustedKeys::new().key(signer.key_id(), signer.public_key()))?;
    /// let trusted = outbox.trusted_command_keys()?.expect("required");
    /// assert_eq!(trusted.key_ids().collect::<Vec<_>>(), ["cloud-2027"]);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn require_signed_commands(&self, keys: TrustedKeys) -> Result<()> {
        keys.validate(self.shared.options.inbox_retention)?;
        self.with_policy_tx(|tx| {
            trust::require(tx, &trust::policy_of(&keys), "Outbox::require_signed_commands")?;
            Ok(())
        })
    }

    /// Stops requiring signed commands on this file (logged like
    /// [`require_signed_commands`](Self::require_signed_commands)). Commands are then accepted
    /// from anyone who can publish on the command topic: see docs/security.md.
    pub fn stop_requiring_signed_commands(&self) -> Result<()> {
        self.with_policy_tx(|tx| {
            trust::stop(tx, "Outbox::stop_requiring_signed_commands")?;
            Ok(())
        })
    }

    /// The keys this file requires commands to be signed by, or `None` when it accepts unsigned
    /// commands.
    pub fn trusted_command_keys(&self) -> Result<Option<TrustedKeys>> {
        Ok(trust::load(&self.lock())?.as_ref().map(trust::keys_of))
    }

    fn with_policy_tx(&self, f: impl FnOnce(&Connection) -> Result<()>) -> Result<()> {
        self.check_can_write("Outbox::require_signed_commands")?;
        let _turn = self.enter_gate()?;
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        f(&tx)?;
        tx.commit()?;
        Ok(())
    }
}
