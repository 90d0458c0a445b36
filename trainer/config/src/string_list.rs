//! [`StringList`]: a key that takes one string or a list of strings, as verl's `train_files`, `logger` and
//! `target_modules` do (`trainer.logger=console` and `trainer.logger=[console,jsonl]` are both valid).

use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One string or a list of strings; a single element is written back as a plain string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StringList(pub Vec<String>);

impl StringList {
    /// A list holding one string.
    pub fn one(s: &str) -> Self {
        Self(vec![s.to_string()])
    }

    /// The strings, in order.
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    /// Whether `s` is one of the strings.
    pub fn contains(&self, s: &str) -> bool {
        self.0.iter().any(|x| x == s)
    }
}

impl Serialize for StringList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for StringList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StringList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StringList, E> {
                Ok(StringList::one(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<StringList, E> {
                Ok(StringList(vec![v.to_string()]))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<StringList, E> {
                Ok(StringList(vec![v.to_string()]))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<StringList, E> {
                Ok(StringList(vec![v.to_string()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StringList, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(StringList(out))
            }
        }
        d.deserialize_any(V)
    }
}
