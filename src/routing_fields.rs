//! Routing fields: the envelope's `id`, `src`, `ep`, `seq`, `key` and `type` repeated outside the
//! payload, where a cloud's rules engine reads them without decoding CBOR (see
//! [`RelayConfig::routing_fields`](crate::RelayConfig::routing_fields)). Under MQTT 5 they ride
//! as user properties beside the Content Type property; on Azure IoT Hub, which speaks 3.1.1, in
//! the property bag at the end of the topic. The payload is unchanged either way: the fields
//! are a copy, and a consumer that decodes the envelope needs none of them.
//!
//! A leaf below the relay's settings, the publishing side and the MQTT client, which all use it.

use crate::envelope::{EnvelopeFormat, Fields, GapFields};

/// Where the fields go on this relay's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// MQTT 5 user properties, and the Content Type property.
    UserProperties,
    /// Azure IoT Hub's property bag: `key=value` pairs, URL-encoded, after the events topic, with
    /// the content type as the system property `$.ct`.
    PropertyBag,
}

/// A publish's routing fields, in the envelope's key order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Routing {
    pub pairs: Vec<(&'static str, String)>,
    pub content_type: &'static str,
    /// IoT Hub's `$.ce`: its routing reads a body as JSON only with `utf-8` here.
    pub content_encoding: Option<&'static str>,
}

/// Bytes a batch's fields take at most beside its source name (see [`Routing::batch`]): the
/// content type, and `ep`, `seq` (a range) and `n` with their longest values.
pub(crate) const BATCH_BYTES_BESIDE_SOURCE: usize = (3 + "application/cbor".len())
    + (5 + "src".len())
    + (5 + "ep".len() + 20)
    + (5 + "seq".len() + 41)
    + (5 + "n".len() + 20);

impl Routing {
    /// A message's fields: `id` (the UUID in text), `src`, `ep` (when it has an epoch), `seq`,
    /// `key` (also when empty) and `type` (when it has one).
    pub(crate) fn message(f: &Fields<'_>, format: EnvelopeFormat) -> Routing {
        let mut pairs = Vec::with_capacity(6);
        pairs.push(("id", f.id.to_string()));
        pairs.push(("src", f.source.to_owned()));
        if f.epoch != 0 {
            pairs.push(("ep", f.epoch.to_string()));
        }
        pairs.push(("seq", f.seq.to_string()));
        pairs.push(("key", f.key.to_owned()));
        if let Some(t) = f.event_type {
            pairs.push(("type", t.to_owned()));
        }
        Routing::with(pairs, format)
    }

    fn with(pairs: Vec<(&'static str, String)>, format: EnvelopeFormat) -> Routing {
        Routing {
            pairs,
            content_type: format.content_type(),
            content_encoding: format.is_json().then_some("utf-8"),
        }
    }

    /// A gap notice's: `id`, `src`, `ep`, `gap` (`first-last`) and `cause`.
    pub(crate) fn notice(g: &GapFields<'_>, format: EnvelopeFormat) -> Routing {
        let pairs = vec![
            ("id", g.id.to_string()),
            ("src", g.source.to_owned()),
            ("ep", g.epoch.to_string()),
            ("gap", format!("{}-{}", g.first, g.last)),
            ("cause", g.cause.to_owned()),
        ];
        Routing::with(pairs, format)
    }

    /// A batch's, from its members' (in order): `src`, `ep`, `seq` as the range `first-last`, and
    /// `n`, the messages in it. Ids, keys and types are the members' own, inside the payload.
    pub(crate) fn batch<'a>(mut members: impl Iterator<Item = &'a Routing>) -> Option<Routing> {
        let first = members.next()?;
        let (n, last) = members.fold((1_usize, first), |(n, _), r| (n + 1, r));
        let get =
            |r: &'a Routing, name: &str| r.pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone());
        let mut pairs = Vec::with_capacity(4);
        pairs.push(("src", get(first, "src").unwrap_or_default()));
        if let Some(ep) = get(first, "ep") {
            pairs.push(("ep", ep));
        }
        let seq = |r| get(r, "seq").unwrap_or_default();
        pairs.push(("seq", format!("{}-{}", seq(first), seq(last))));
        pairs.push(("n", n.to_string()));
        Some(Routing {
            pairs,
            content_type: first.content_type,
            content_encoding: first.content_encoding,
        })
    }

    /// The value of the field `name`, if it has one.
    pub(crate) fn value(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Bytes these fields add to an MQTT 5 PUBLISH's properties: each user property is an id
    /// byte and two length-prefixed strings, the content type an id byte and one; plus what the
    /// properties' length may grow by.
    pub(crate) fn property_bytes(&self) -> usize {
        let pairs: usize = self.pairs.iter().map(|(k, v)| 5 + k.len() + v.len()).sum();
        pairs + 3 + self.content_type.len() + 3
    }

    /// `topic` with the fields in Azure IoT Hub's property bag after it: URL-encoded
    /// `name=value` pairs joined by `&`, the content type as `$.ct` first. An events topic
    /// that has a bag already keeps it, and these follow.
    pub(crate) fn in_property_bag(&self, topic: &str) -> String {
        let mut out = String::with_capacity(topic.len() + 160);
        out.push_str(topic);
        if !topic.ends_with('/') {
            out.push('&');
        }
        out.push_str("%24.ct=");
        url_encode_into(&mut out, self.content_type);
        if let Some(ce) = self.content_encoding {
            out.push_str("&%24.ce=");
            url_encode_into(&mut out, ce);
        }
        for (name, value) in &self.pairs {
            out.push('&');
            if crate::mutant::active("property-bag-unencoded") {
                out.push_str(name);
                out.push('=');
                out.push_str(value);
                continue;
            }
            url_encode_into(&mut out, name);
            out.push('=');
            url_encode_into(&mut out, value);
        }
        out
    }
}

/// Percent-encodes every byte but the unreserved ones (letters, digits, `-`, `_`, `.`, `~`):
/// a `/`, `&`, `=`, `+` or `#` in a key can then neither end the bag's pair nor the topic level.
fn url_encode_into(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::MessageId;

    fn fields<'a>(id: &'a MessageId, key: &'a str) -> Fields<'a> {
        Fields {
            id,
            source: "pump-17",
            epoch: 7,
            seq: 42,
            key,
            created_ms: 1,
            event_type: Some("Reading.v1"),
            headers: None,
        }
    }

    #[test]
    fn a_message_carries_the_envelopes_routing_fields_in_its_order() {
        let id = MessageId::from_key("a");
        let r = Routing::message(&fields(&id, "k"), EnvelopeFormat::Cbor);
        let names: Vec<&str> = r.pairs.iter().map(|(k, _)| *k).collect();
        assert_eq!(names, ["id", "src", "ep", "seq", "key", "type"]);
        assert_eq!(r.pairs[0].1, id.to_string());
        assert_eq!(r.pairs[3].1, "42");
    }

    #[test]
    fn the_property_bag_encodes_what_would_end_a_pair_or_a_level() {
        let id = MessageId::from_key("a");
        let r = Routing::message(&fields(&id, "a/b&c=d e+#%é"), EnvelopeFormat::Cbor);
        let topic = r.in_property_bag("devices/d/messages/events/");
        assert!(topic.starts_with("devices/d/messages/events/%24.ct=application%2Fcbor&id="));
        assert!(
            topic.ends_with("&key=a%2Fb%26c%3Dd%20e%2B%23%25%C3%A9&type=Reading.v1"),
            "{topic}"
        );
        assert_eq!(topic.matches('/').count(), 4);
        let kept = r.in_property_bag("devices/d/messages/events/mine=1");
        assert!(
            kept.starts_with("devices/d/messages/events/mine=1&%24.ct="),
            "{kept}"
        );
        // IoT Hub routes on a JSON body only with its content type and encoding set.
        let json = Routing::message(&fields(&id, "k"), EnvelopeFormat::Json)
            .in_property_bag("devices/d/messages/events/");
        assert!(
            json.starts_with("devices/d/messages/events/%24.ct=application%2Fjson&%24.ce=utf-8&id="),
            "{json}"
        );
    }

    #[test]
    fn a_batch_names_its_range_and_count() {
        let ids: Vec<MessageId> = ["a", "b", "c"].iter().map(|k| MessageId::from_key(k)).collect();
        let members: Vec<Routing> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let mut f = fields(id, "k");
                f.seq = 10 + i as u64;
                Routing::message(&f, EnvelopeFormat::Cbor)
            })
            .collect();
        let b = Routing::batch(members.iter()).expect("a batch");
        assert_eq!(
            b.pairs,
            [
                ("src", "pump-17".to_owned()),
                ("ep", "7".to_owned()),
                ("seq", "10-12".to_owned()),
                ("n", "3".to_owned())
            ]
        );
        assert!(b.property_bytes() <= BATCH_BYTES_BESIDE_SOURCE + "pump-17".len());
    }
}
