//! The strict JSON of a safetensors header: serde visitors that reject duplicate keys at any level and keep
//! the entries in file order, and the checks of each tensor entry and of `__metadata__`.

use super::*;

pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn parse_metadata(entry: &Value) -> Result<Option<Vec<(String, String)>>, String> {
    match entry {
        Value::Null => Ok(None),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(format!(
                    "__metadata__ value for '{k}' is {}, expected a string",
                    kind(other)
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        other => Err(format!(
            "__metadata__ is {}, expected an object of strings",
            kind(other)
        )),
    }
}

pub(super) fn parse_tensor(name: String, entry: Entry) -> Result<TensorInfo, String> {
    let q = Quoted(&name);
    let mut fields = match entry {
        Entry::Fields(fields) => fields,
        Entry::Other(value) => {
            return Err(format!(
                "tensor {q} is {}, expected an object",
                kind(&value)
            ))
        }
    };
    let mut field = |i: usize| {
        fields[i]
            .take()
            .ok_or_else(|| format!("tensor {q} has no '{}'", FIELDS[i]))
    };
    let dtype = match field(0)? {
        Field::Dtype(dtype) => dtype,
        Field::Value(value) if value.is_string() => {
            let s = value.as_str().unwrap_or_default();
            return Err(format!("tensor {q} has unknown dtype '{s}'"));
        }
        Field::Value(other) => {
            return Err(format!(
                "tensor {q}: dtype is {}, expected a string",
                kind(&other)
            ))
        }
        Field::Ints(_) => return Err(format!("tensor {q}: dtype is an array, expected a string")),
    };
    let mut ints = |i: usize| -> Result<Vec<u64>, String> {
        let key = FIELDS[i];
        match field(i)? {
            Field::Ints(ints) => Ok(ints),
            Field::Value(value) if value.is_array() => value
                .as_array()
                .into_iter()
                .flatten()
                .map(|v| {
                    v.as_u64().ok_or_else(|| {
                        format!("tensor {q}: {key} entry {v} is not a non-negative integer")
                    })
                })
                .collect(),
            Field::Value(_) | Field::Dtype(_) => Err(format!("tensor {q}: {key} is not an array")),
        }
    };
    let shape = ints(1)?;
    let offsets = ints(2)?;
    let [begin, end] = offsets[..] else {
        return Err(format!(
            "tensor {q}: data_offsets has {} entries, expected 2",
            offsets.len()
        ));
    };
    if end < begin {
        return Err(format!(
            "tensor {q}: data_offsets [{begin}, {end}] end before they begin"
        ));
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("tensor {q}: shape {shape:?} overflows the element count"))?;
    let bits = numel
        .checked_mul(dtype.bits())
        .ok_or_else(|| format!("tensor {q}: shape {shape:?} of {dtype} overflows the byte size"))?;
    let nbytes = bits.div_ceil(8);
    if end - begin != nbytes {
        return Err(format!(
            "tensor {q}: data_offsets [{begin}, {end}] hold {} bytes but dtype {dtype} and shape \
             {shape:?} need {nbytes}",
            end - begin
        ));
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// Visitor methods that build the JSON value (as [`StrictVisitor`] does) and wrap it with `$wrap`, one per
/// listed kind: a visitor that types some values forwards the others here, for the error message that names
/// what was found instead.
macro_rules! forward_to_strict {
    ($out:ty, $wrap:expr; $($kind:ident),+) => {
        $(forward_to_strict!(@one $out, $wrap, $kind);)+
    };
    (@one $out:ty, $wrap:expr, bool) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<$out, E> {
            StrictVisitor.visit_bool(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, i64) => {
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<$out, E> {
            StrictVisitor.visit_i64(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, u64) => {
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<$out, E> {
            StrictVisitor.visit_u64(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, f64) => {
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<$out, E> {
            StrictVisitor.visit_f64(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, str) => {
        fn visit_str<E: de::Error>(self, v: &str) -> Result<$out, E> {
            StrictVisitor.visit_str(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, unit) => {
        fn visit_unit<E: de::Error>(self) -> Result<$out, E> {
            Ok(($wrap)(Value::Null))
        }
        fn visit_none<E: de::Error>(self) -> Result<$out, E> {
            Ok(($wrap)(Value::Null))
        }
    };
    (@one $out:ty, $wrap:expr, seq) => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<$out, A::Error> {
            StrictVisitor.visit_seq(seq).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, map) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<$out, A::Error> {
            StrictVisitor.visit_map(map).map($wrap)
        }
    };
}

/// The fields of a tensor entry that the format defines, in [`Entry::Fields`] order.
pub(super) const FIELDS: [&str; 3] = ["dtype", "shape", "data_offsets"];

/// One tensor entry: its known fields (other fields are checked for duplicates, then ignored), or the
/// value itself when it is not an object (for the error message).
pub(super) enum Entry {
    Fields([Option<Field>; 3]),
    Other(Box<Value>),
}

/// A known field of a tensor entry, typed while it streams by when it has the expected form (a known dtype
/// name; an array of non-negative integers), else the JSON value for the error message. Typing here, rather
/// than keeping a JSON value per field, halved the allocations of a 22k-tensor header's parse.
pub(super) enum Field {
    Dtype(Dtype),
    Ints(Vec<u64>),
    Value(Box<Value>),
}

/// Deserializes a [`Field`]: the `dtype` field when `.0`, else `shape` / `data_offsets`.
pub(super) struct FieldSeed(bool);

impl<'de> de::DeserializeSeed<'de> for FieldSeed {
    type Value = Field;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Field, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    forward_to_strict!(Field, |v| Field::Value(Box::new(v)); bool, i64, u64, f64, unit, map);
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
        match Dtype::from_name(v) {
            Some(dtype) if self.0 => Ok(Field::Dtype(dtype)),
            _ => StrictVisitor
                .visit_str(v)
                .map(|v| Field::Value(Box::new(v))),
        }
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field, A::Error> {
        if self.0 {
            return StrictVisitor
                .visit_seq(seq)
                .map(|v| Field::Value(Box::new(v)));
        }
        let mut ints = Vec::with_capacity(seq.size_hint().unwrap_or(4));
        while let Some(IntOrValue(item)) = seq.next_element()? {
            match item {
                Ok(int) => ints.push(int),
                Err(value) => {
                    // Not all integers: keep the whole array as JSON values for the error message.
                    let mut values: Vec<Value> =
                        ints.into_iter().map(|i| Value::Number(i.into())).collect();
                    values.push(value);
                    while let Some(StrictValue(v)) = seq.next_element()? {
                        values.push(v);
                    }
                    return Ok(Field::Value(Box::new(Value::Array(values))));
                }
            }
        }
        Ok(Field::Ints(ints))
    }
}

/// An array element: a non-negative integer, or any other JSON value.
pub(super) struct IntOrValue(Result<u64, Value>);

impl<'de> Deserialize<'de> for IntOrValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IntOrValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IntOrValue, E> {
                Ok(IntOrValue(Ok(v)))
            }
            forward_to_strict!(IntOrValue, |v| IntOrValue(Err(v)); bool, i64, f64, str, unit, seq, map);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entry;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a tensor entry")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entry, A::Error> {
                let mut fields: [Option<Field>; 3] = [None, None, None];
                let mut others: Vec<String> = Vec::new();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    let seen = match FIELDS.iter().position(|f| *f == key) {
                        Some(i) => {
                            let v = map.next_value_seed(FieldSeed(i == 0))?;
                            fields[i].replace(v).is_some()
                        }
                        None => {
                            let StrictValue(_) = map.next_value()?;
                            if others.iter().any(|o| *o == key) {
                                true
                            } else {
                                others.push(key.to_string());
                                false
                            }
                        }
                    };
                    if seen {
                        return Err(de::Error::custom(format_args!("duplicate key '{key}'")));
                    }
                }
                Ok(Entry::Fields(fields))
            }
            forward_to_strict!(Entry, |v| Entry::Other(Box::new(v)); bool, i64, u64, f64, str, unit, seq);
        }
        d.deserialize_any(V)
    }
}

/// The header's top level, streamed: tensor entries in file order plus `__metadata__`, without building a
/// JSON tree of the whole header (a 90k-tensor header spent most of its parse in that tree). Duplicate
/// keys are refused here at every level, as [`StrictValue`] does.
pub(super) enum Top {
    Object {
        entries: Vec<(String, Entry)>,
        metadata: Option<Value>,
    },
    Other(Value),
}

/// Deserializes a [`Top`], reserving room for about `.0` entries (estimated from the header's length: growing
/// the list of a 22k-tensor header step by step moved megabytes).
pub(super) struct TopSeed(pub(super) usize);

impl<'de> de::DeserializeSeed<'de> for TopSeed {
    type Value = Top;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Top, D::Error> {
        struct V(usize);
        impl<'de> Visitor<'de> for V {
            type Value = Top;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top, A::Error> {
                let mut entries: Vec<(String, Entry)> = Vec::with_capacity(self.0);
                let mut metadata = None;
                // Duplicate tensor names are caught when the name index is built.
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        let StrictValue(v) = map.next_value()?;
                        if metadata.replace(v).is_some() {
                            return Err(de::Error::custom("duplicate key '__metadata__'"));
                        }
                    } else {
                        let entry: Entry = map.next_value()?;
                        entries.push((key, entry));
                    }
                }
                Ok(Top::Object { entries, metadata })
            }
            forward_to_strict!(Top, Top::Other; bool, i64, u64, f64, str, unit, seq);
        }
        d.deserialize_any(V(self.0))
    }
}

/// A JSON value that refuses duplicate object keys at every level (serde_json keeps the last silently).
pub(super) struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

pub(super) struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key '{key}'")));
            }
            let StrictValue(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}
