//! Decoding a payload into the application's type when the sender wrote a whole number where the
//! type has a float: `{"celsius": 26}` from a JSON command line, or `26` from Python's `cbor2`,
//! is the float 26.0 to the handler, as a JSON decoder would have it.
//!
//! Only a fallback: a payload is first decoded as it stands (ciborium's own rules, tags and
//! all); this runs only when that fails, on the decoded [`Value`], and accepts an integer for a
//! float only if the float holds it exactly. Everything else is decoded as ciborium would.

use ciborium::Value;
use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};

/// Why a value did not fit.
#[derive(Debug)]
pub(crate) struct Mismatch(pub String);

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Mismatch {}

impl de::Error for Mismatch {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Mismatch(msg.to_string())
    }
}

/// `value` as a `T`, a whole number standing for a float where `T` has one.
pub(crate) fn deserialize<T: de::DeserializeOwned>(value: &Value) -> Result<T, Mismatch> {
    T::deserialize(Lenient(value))
}

/// Largest magnitude below which every integer is exact as an `f64` (2^53).
const F64_EXACT: i128 = 1 << 53;

fn as_float(value: &Value) -> Option<f64> {
    match value {
        Value::Float(f) => Some(*f),
        Value::Integer(i) => {
            let i = i128::from(*i);
            // The range check makes the conversion exact.
            (i.abs() <= F64_EXACT).then_some(i as f64)
        }
        Value::Tag(_, inner) => as_float(inner),
        _ => None,
    }
}

fn unexpected(value: &Value) -> de::Unexpected<'_> {
    match value {
        Value::Integer(i) => match i64::try_from(*i) {
            Ok(n) => de::Unexpected::Signed(n),
            Err(_) => de::Unexpected::Other("a large integer"),
        },
        Value::Bytes(b) => de::Unexpected::Bytes(b),
        Value::Float(f) => de::Unexpected::Float(*f),
        Value::Text(t) => de::Unexpected::Str(t),
        Value::Bool(b) => de::Unexpected::Bool(*b),
        Value::Null => de::Unexpected::Unit,
        Value::Tag(_, _) => de::Unexpected::Other("a tagged item"),
        Value::Array(_) => de::Unexpected::Seq,
        Value::Map(_) => de::Unexpected::Map,
        _ => de::Unexpected::Other("an unknown item"),
    }
}

struct Lenient<'a>(&'a Value);

impl<'de> de::Deserializer<'de> for Lenient<'_> {
    type Error = Mismatch;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Mismatch> {
        match self.0 {
            Value::Integer(i) => {
                let i = i128::from(*i);
                match (u64::try_from(i), i64::try_from(i)) {
                    (Ok(u), _) => visitor.visit_u64(u),
                    (_, Ok(s)) => visitor.visit_i64(s),
                    _ => visitor.visit_i128(i),
                }
            }
            Value::Bytes(b) => visitor.visit_bytes(b),
            Value::Float(f) => visitor.visit_f64(*f),
            Value::Text(t) => visitor.visit_str(t),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Null => visitor.visit_unit(),
            Value::Tag(_, inner) => Lenient(inner).deserialize_any(visitor),
            Value::Array(items) => visitor.visit_seq(Seq(items.iter())),
            Value::Map(entries) => visitor.visit_map(Map {
                entries: entries.iter(),
                value: None,
            }),
            other => Err(de::Error::invalid_type(unexpected(other), &visitor)),
        }
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Mismatch> {
        match as_float(self.0) {
            Some(f) => visitor.visit_f64(f),
            None => Err(de::Error::invalid_type(unexpected(self.0), &visitor)),
        }
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Mismatch> {
        match as_float(self.0) {
            // Only what an f32 holds exactly: the same rule, narrower.
            Some(f) if f64::from(f as f32) == f || f.is_nan() => visitor.visit_f32(f as f32),
            _ => Err(de::Error::invalid_type(unexpected(self.0), &visitor)),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Mismatch> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Mismatch> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Mismatch> {
        match self.0 {
            Value::Tag(_, inner) => Lenient(inner).deserialize_enum(_name, _variants, visitor),
            Value::Text(t) => visitor.visit_enum(t.as_str().into_deserializer()),
            Value::Map(entries) if entries.len() == 1 => {
                let (variant, value) = &entries[0];
                visitor.visit_enum(Enum { variant, value })
            }
            other => Err(de::Error::invalid_type(unexpected(other), &"an enum")),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 char str string bytes byte_buf unit
        unit_struct seq tuple tuple_struct map struct identifier ignored_any
    }
}

struct Seq<'a>(std::slice::Iter<'a, Value>);

impl<'de> de::SeqAccess<'de> for Seq<'_> {
    type Error = Mismatch;

    fn next_element_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, Mismatch> {
        self.0.next().map(|v| seed.deserialize(Lenient(v))).transpose()
    }
}

struct Map<'a> {
    entries: std::slice::Iter<'a, (Value, Value)>,
    value: Option<&'a Value>,
}

impl<'de> de::MapAccess<'de> for Map<'_> {
    type Error = Mismatch;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Mismatch> {
        match self.entries.next() {
            Some((k, v)) => {
                self.value = Some(v);
                seed.deserialize(Lenient(k)).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Mismatch> {
        match self.value.take() {
            Some(v) => seed.deserialize(Lenient(v)),
            None => Err(de::Error::custom("a map value without its key")),
        }
    }
}

struct Enum<'a> {
    variant: &'a Value,
    value: &'a Value,
}

impl<'a, 'de> de::EnumAccess<'de> for Enum<'a> {
    type Error = Mismatch;
    type Variant = Lenient<'a>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Lenient<'a>), Mismatch> {
        Ok((seed.deserialize(Lenient(self.variant))?, Lenient(self.value)))
    }
}

impl<'de> de::VariantAccess<'de> for Lenient<'_> {
    type Error = Mismatch;

    fn unit_variant(self) -> Result<(), Mismatch> {
        de::Deserialize::deserialize(self)
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, Mismatch> {
        seed.deserialize(self)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, Mismatch> {
        de::Deserializer::deserialize_any(self, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Mismatch> {
        de::Deserializer::deserialize_any(self, visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(json_like: Value) -> Value {
        json_like
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Threshold {
        celsius: f64,
        probe: u32,
        hysteresis: Option<f32>,
        mode: Mode,
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    enum Mode {
        Heat,
        Hold { minutes: f64 },
    }

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(
            entries
                .into_iter()
                .map(|(k, v)| (Value::Text(k.into()), v))
                .collect(),
        )
    }

    #[test]
    fn a_whole_number_fills_a_float_field_and_integers_stay_integers() {
        let v = value(map(vec![
            ("celsius", Value::Integer(26.into())),
            ("probe", Value::Integer(3.into())),
            ("hysteresis", Value::Integer(2.into())),
            (
                "mode",
                map(vec![("Hold", map(vec![("minutes", Value::Integer(5.into()))]))]),
            ),
        ]));
        let t: Threshold = deserialize(&v).expect("lenient");
        assert_eq!(
            t,
            Threshold {
                celsius: 26.0,
                probe: 3,
                hysteresis: Some(2.0),
                mode: Mode::Hold { minutes: 5.0 }
            }
        );
        let unit = value(map(vec![
            ("celsius", Value::Float(1.5)),
            ("probe", Value::Integer(1.into())),
            ("hysteresis", Value::Null),
            ("mode", Value::Text("Heat".into())),
        ]));
        let t: Threshold = deserialize(&unit).expect("lenient");
        assert_eq!((t.hysteresis, t.mode), (None, Mode::Heat));
    }

    #[test]
    fn a_float_never_fills_an_integer_field_and_an_inexact_integer_no_float() {
        assert!(deserialize::<u32>(&Value::Float(3.0)).is_err());
        assert!(deserialize::<f64>(&Value::Integer(((1u64 << 53) + 1).into())).is_err());
        assert_eq!(
            deserialize::<f64>(&Value::Integer((1i64 << 53).into())).ok(),
            Some(9007199254740992.0)
        );
        assert!(deserialize::<f32>(&Value::Integer(16_777_217.into())).is_err());
        assert!(deserialize::<f64>(&Value::Text("26".into())).is_err());
        assert_eq!(
            deserialize::<Vec<f64>>(&Value::Array(vec![Value::Integer((-4).into())])).ok(),
            Some(vec![-4.0])
        );
    }
}
