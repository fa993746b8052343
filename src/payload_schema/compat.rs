//! Whether a new version of an event's schema is a compatible change of the one before it: events
//! are an API, so a version may only add optional fields. A consumer written for the old version
//! then reads every new event, and a new consumer every old one.

use cddl_cat::ivt::{Literal, Node};

use super::path::unwrap_occur;
use super::registry::Compiled;

/// `Err` names the rule `new` breaks against `old`.
pub(super) fn check(old: &Compiled, new: &Compiled) -> Result<(), String> {
    let old_root = root(old)?;
    let new_root = root(new)?;
    let (Node::Map(old_map), Node::Map(new_map)) = (old_root, new_root) else {
        if old_root == new_root {
            return Ok(());
        }
        return Err(format!(
            "its payload rule {} changed, and only a map may change between versions (by adding optional fields)",
            new.root
        ));
    };
    let old_fields = fields(&old_map.members)?;
    let new_fields = fields(&new_map.members)?;
    for (key, (value, optional)) in &old_fields {
        match new_fields.iter().find(|(k, _)| k == key) {
            None => return Err(format!("field {key:?} was removed: a field may never be removed")),
            Some((_, (v, o))) if v != value || o != optional => {
                return Err(format!(
                    "field {key:?} changed (type or optionality): a field may never be repurposed"
                ));
            }
            Some(_) => {}
        }
    }
    for (key, (_, optional)) in &new_fields {
        if !optional && !old_fields.iter().any(|(k, _)| k == key) {
            return Err(format!(
                "new field {key:?} is required: a field added in a new version must be optional (`? {key}: ...`)"
            ));
        }
    }
    Ok(())
}

fn root(schema: &Compiled) -> Result<&Node, String> {
    let rule = |name: &str| {
        schema
            .rules
            .rules
            .get(name)
            .map(|r| &r.node)
            .ok_or_else(|| format!("rule {name} is missing"))
    };
    let mut node = rule(&schema.root)?;
    // A root that names another rule is that rule (`order = order-v1`); a cycle stops the walk.
    for _ in 0..32 {
        match node {
            Node::Rule(r) if r.generic_args.is_empty() => node = rule(&r.name)?,
            _ => break,
        }
    }
    Ok(node)
}

/// A map member: its key, its value's type and whether it may be absent.
type Field<'n> = (String, (&'n Node, bool));

/// A map's members by text key: the value's type and whether it may be absent. A member that is
/// not a plain `key: type` cannot be compared, and refuses the change.
fn fields(members: &[Node]) -> Result<Vec<Field<'_>>, String> {
    members
        .iter()
        .map(|m| {
            let (member, optional) = unwrap_occur(m);
            match member {
                Node::KeyValue(kv) => match &*kv.key {
                    Node::Literal(Literal::Text(k)) => Ok((k.clone(), (&*kv.value, optional))),
                    _ => Err("a map member without a text key cannot be checked for compatibility".into()),
                },
                _ => Err("a map member that is not `key: type` cannot be checked for compatibility".into()),
            }
        })
        .collect()
}
