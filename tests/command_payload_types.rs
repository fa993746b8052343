//! A command's payload as other languages write it: a whole number where the handler's type has
//! a float (`{"celsius": 26}` from JSON, `26` from Python's `cbor2`) is applied, not rejected for
//! good; a payload that truly does not fit is rejected with a reason an operator can read.
//!
//! Broken builds these catch: a decoder that takes ciborium's strict rule (the integer is
//! dead-lettered as "expected float"), and a rejection reason that carries ciborium's `Debug`
//! form (`Semantic(None, "...")`).

mod common;

use common::{TestResult, command_bytes, temp_db};
use edge_outbox::{ApplyOutcome, Error, MessageId, Outbox, Received};

#[derive(serde::Deserialize)]
struct SetThreshold {
    celsius: f64,
}

/// Stores a command carrying `payload` and applies it with a handler that wants a `SetThreshold`;
/// what the handler saw, and the outcome.
fn apply<T: serde::Serialize>(payload: &T) -> TestResult<(Option<f64>, ApplyOutcome)> {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let id = MessageId::new_v7();
    let stored = outbox.receive("commands/threshold", &command_bytes(id, "t", payload)?)?;
    assert_eq!(stored, Received::Stored(id));
    let mut seen = None;
    let outcome = outbox.apply_next(|_tx, cmd| {
        let set: SetThreshold = cmd.payload_as()?;
        seen = Some(set.celsius);
        Ok::<_, Error>(())
    })?;
    Ok((seen, outcome))
}

#[test]
fn a_whole_number_is_applied_for_a_float_field() -> TestResult {
    #[derive(serde::Serialize)]
    struct AsPythonWritesIt {
        celsius: u8,
    }
    let (seen, outcome) = apply(&AsPythonWritesIt { celsius: 26 })?;
    assert!(matches!(outcome, ApplyOutcome::Applied { .. }), "{outcome:?}");
    assert_eq!(seen, Some(26.0));
    Ok(())
}

#[test]
fn a_payload_that_does_not_fit_is_rejected_in_words() -> TestResult {
    #[derive(serde::Serialize)]
    struct Wrong {
        celsius: &'static str,
    }
    let (seen, outcome) = apply(&Wrong { celsius: "warm" })?;
    let ApplyOutcome::Rejected { error: reason, .. } = outcome else {
        return Err(format!("not rejected: {outcome:?}").into());
    };
    assert_eq!(seen, None);
    assert!(
        reason.contains("expected float") || reason.contains("expected f64"),
        "{reason}"
    );
    assert!(
        !reason.contains("Semantic("),
        "a Debug form reached the operator: {reason}"
    );
    Ok(())
}
