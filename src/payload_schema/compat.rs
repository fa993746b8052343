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
        if same(old_root, old, new_root, new, 0) {
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
            Some((_, (v, o))) if !same(value, old, v, new, 0) || o != optional => {
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

/// How deep [`same`] follows rules and members; a schema deeper (or recursive, `tree = [* tree]`)
/// is not compared, and its change is refused.
const MAX_DEPTH: usize = 32;

/// Whether `a` (of `old`) and `b` (of `new`) describe the same values, rules referenced by name
/// followed on each side: a field of type `amount` is unchanged only if `amount` is.
fn same(a: &Node, old: &Compiled, b: &Node, new: &Compiled, depth: usize) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    let (Some(a), Some(b)) = (resolve(a, old), resolve(b, new)) else {
        return false;
    };
    let all = |x: &[Node], y: &[Node]| {
        x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, old, y, new, depth + 1))
    };
    match (a, b) {
        (Node::Map(x), Node::Map(y)) => all(&x.members, &y.members),
        (Node::Array(x), Node::Array(y)) => all(&x.members, &y.members),
        (Node::Group(x), Node::Group(y)) => all(&x.members, &y.members),
        (Node::Choice(x), Node::Choice(y)) => all(&x.options, &y.options),
        (Node::KeyValue(x), Node::KeyValue(y)) => {
            x.cut == y.cut
                && same(&x.key, old, &y.key, new, depth + 1)
                && same(&x.value, old, &y.value, new, depth + 1)
        }
        (Node::Occur(x), Node::Occur(y)) => x.limit == y.limit && same(&x.node, old, &y.node, new, depth + 1),
        // Literals, prelude types, ranges, controls, generic rules: compared as written.
        _ => a == b,
    }
}

/// `node` with (non-generic) rule names followed in `schema`; `None` for a missing rule or a cycle.
fn resolve<'n>(mut node: &'n Node, schema: &'n Compiled) -> Option<&'n Node> {
    for _ in 0..MAX_DEPTH {
        match node {
            Node::Rule(r) if r.generic_args.is_empty() => node = &schema.rules.rules.get(&r.name)?.node,
            _ => return Some(node),
        }
    }
    None
}

fn root(schema: &Compiled) -> Result<&Node, String> {
    let named = &schema
        .rules
        .rules
        .get(&schema.root)
        .ok_or_else(|| format!("rule {} is missing", schema.root))?
        .node;
    // A root that names another rule is that rule (`order = order-v1`).
    resolve(named, schema).ok_or_else(|| format!("rule {} names a missing rule, or a cycle", schema.root))
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
