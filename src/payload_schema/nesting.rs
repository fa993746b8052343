//! A bound on how deeply a CDDL text nests, checked before it is parsed: the parser recurses once
//! per level with no limit of its own, so a deep enough text (from `Options::schema`, a row
//! written into `edge_outbox_schemas` by SQL, or a published contract) would overflow the stack
//! and abort the process instead of failing.

/// Deepest nesting of `(`, `[`, `{` and `<` accepted: far beyond any event's schema, and well
/// within a 2 MiB thread stack in a debug build.
pub(crate) const MAX_NESTING: usize = 24;

/// `Err` names the depth when `cddl` nests deeper than [`MAX_NESTING`]; text strings and
/// comments do not count.
pub(crate) fn check(cddl: &str) -> Result<(), String> {
    let (mut depth, mut deepest) = (0usize, 0usize);
    // Inside a text ('"') or byte ('\'') string, or a comment.
    let (mut quote, mut in_comment) = (None, false);
    let (mut previous, mut escaped) = (' ', false);
    for c in cddl.chars() {
        let after = std::mem::replace(&mut previous, c);
        match (c, quote) {
            ('\n', _) => in_comment = false,
            _ if in_comment => {}
            _ if escaped => escaped = false,
            ('\\', Some(_)) => escaped = true,
            (q, Some(open)) if q == open => quote = None,
            (_, Some(_)) => {}
            ('"' | '\'', None) => quote = Some(c),
            (';', None) => in_comment = true,
            ('(' | '[' | '{' | '<', None) => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            // `=>` (a map member) closes nothing.
            ('>', None) if after == '=' => {}
            (')' | ']' | '}' | '>', None) => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if deepest > MAX_NESTING {
        return Err(format!(
            "it nests {deepest} levels deep; at most {MAX_NESTING} are accepted"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_texts_are_refused_whatever_hides_their_brackets() {
        let deep = |open: &str, close: &str| format!("a = {}uint{}", open.repeat(400), close.repeat(400));
        assert!(check(&deep("[", "]")).is_err());
        assert!(check(&deep("{ x: ", "}")).is_err());
        assert!(
            check(&deep("[ \"\\\"\" => ", "]")).is_err(),
            "an escaped quote hides nothing"
        );
        assert!(
            check(&deep("[ 'x]' ", "]")).is_err(),
            "a bracket in a byte string closes nothing"
        );
        assert!(check(&deep("[ ; ]\n", "]")).is_err(), "nor one in a comment");
        assert!(
            check("order = { id: tstr, ? items: [* item] }\nitem = { sku: tstr, \"q]\" => uint }").is_ok()
        );
    }
}
