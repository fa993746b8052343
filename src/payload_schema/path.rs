//! Checks a payload against its schema and, when it fails, finds the field that fails: the CDDL
//! validator says only what it expected, and a writer needs to know where.

use cddl_cat::context::LookupContext;
use cddl_cat::ivt::{Literal, Node, OccurLimit, RuleDef};
use cddl_cat::validate_cbor;
use ciborium::Value;

use super::registry::{Compiled, Violation};

/// How deep the search for the failing field goes: the payload's nesting is bounded by the CBOR
/// check before, this bounds the schema's (a recursive rule).
const MAX_DEPTH: usize = 32;

pub(super) fn check(schema: &Compiled, payload: &[u8]) -> Result<(), Violation> {
    let violation = |path: String, reason: String| Violation {
        schema: schema.def.name(),
        rule: schema.root.clone(),
        path,
        reason,
    };
    let value: Value = ciborium::from_reader(payload)
        .map_err(|e| violation("$".into(), format!("payload is not CBOR: {e}")))?;
    // The validator reads maps into a sorted map, where a repeated key keeps only its last value:
    // `{"total": -1, "total": 1}` would pass as 1 and be read as -1 by the first decoder that
    // keeps the first.
    if let Some(key) = repeated_key(&value) {
        return Err(violation("$".into(), format!("map key {key} is repeated")));
    }
    let root = schema
        .rules
        .lookup_rule(&schema.root)
        .map_err(|e| violation("$".into(), format!("rule {} cannot be used: {e}", schema.root)))?;
    // The whole payload against the root rule as it is stored: no copy of the schema per check.
    match validate_cbor(root, &value, &schema.rules) {
        Ok(()) => Ok(()),
        Err(why) => {
            let (path, reason) = locate(&root.node, &value, &schema.rules, "$".into(), 0)
                .unwrap_or(("$".into(), why.to_string()));
            Err(violation(path, reason))
        }
    }
}

/// A map key that appears twice anywhere in `value`, shown as CBOR diagnostic-ish text.
fn repeated_key(value: &Value) -> Option<String> {
    let mut pending = vec![value];
    while let Some(v) = pending.pop() {
        match v {
            Value::Array(items) => pending.extend(items),
            Value::Tag(_, inner) => pending.push(inner),
            Value::Map(entries) => {
                let mut texts = std::collections::HashSet::new();
                let mut others: Vec<&Value> = Vec::new();
                for (k, v) in entries {
                    let repeated = match k.as_text() {
                        Some(t) => !texts.insert(t),
                        None => {
                            others.contains(&k) || {
                                others.push(k);
                                false
                            }
                        }
                    };
                    if repeated {
                        return Some(k.as_text().map_or_else(|| format!("{k:?}"), |t| format!("{t:?}")));
                    }
                    pending.push(k);
                    pending.push(v);
                }
            }
            _ => {}
        }
    }
    None
}

/// Whether `value` matches `node`, a part of a schema (after a failure only: it copies the part).
fn fits(node: &Node, value: &Value, rules: &dyn LookupContext) -> Result<(), String> {
    let rule = RuleDef {
        generic_parms: Vec::new(),
        node: node.clone(),
    };
    validate_cbor(&rule, value, rules).map_err(|e| e.to_string())
}

/// The path and reason of the innermost part of `value` that `node` refuses, if one can be named:
/// a map's member (`$.items`), an array's element (`$.items[2]`), or what is missing.
fn locate(
    node: &Node,
    value: &Value,
    rules: &dyn LookupContext,
    here: String,
    depth: usize,
) -> Option<(String, String)> {
    if depth > MAX_DEPTH {
        return None;
    }
    let node = resolve(node, rules)?;
    match (node, value) {
        (Node::Map(map), Value::Map(entries)) => {
            for member in &map.members {
                let (member, optional) = unwrap_occur(member);
                let Node::KeyValue(kv) = member else { continue };
                let Node::Literal(Literal::Text(key)) = &*kv.key else {
                    continue;
                };
                let path = format!("{here}.{key}");
                match entries.iter().find(|(k, _)| k.as_text() == Some(key)) {
                    None if !optional => return Some((path, "missing".into())),
                    None => {}
                    Some((_, v)) => {
                        if let Err(why) = fits(&kv.value, v, rules) {
                            return locate(&kv.value, v, rules, path.clone(), depth + 1)
                                .or(Some((path, why)));
                        }
                    }
                }
            }
            None
        }
        (Node::Array(array), Value::Array(items)) => {
            let [only] = array.members.as_slice() else {
                return None;
            };
            let (element, _) = unwrap_occur(only);
            for (i, item) in items.iter().enumerate() {
                let path = format!("{here}[{i}]");
                if let Err(why) = fits(element, item, rules) {
                    return locate(element, item, rules, path.clone(), depth + 1).or(Some((path, why)));
                }
            }
            None
        }
        _ => None,
    }
}

/// `node` with rule names followed (generic rules are left to the validator).
fn resolve<'n>(mut node: &'n Node, rules: &'n dyn LookupContext) -> Option<&'n Node> {
    for _ in 0..MAX_DEPTH {
        match node {
            Node::Rule(r) if r.generic_args.is_empty() => node = &rules.lookup_rule(&r.name).ok()?.node,
            _ => return Some(node),
        }
    }
    None
}

/// A member without its occurrence indicator, and whether it may be absent.
pub(super) fn unwrap_occur(node: &Node) -> (&Node, bool) {
    match node {
        Node::Occur(o) => (
            &o.node,
            matches!(o.limit, OccurLimit::Optional | OccurLimit::ZeroOrMore) || o.limits().0 == 0,
        ),
        _ => (node, false),
    }
}
