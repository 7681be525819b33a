//! A small Python pickle writer (protocol 2): enough for PyTorch's memory snapshot format, which
//! holds only dicts, lists, tuples, strings, integers, floats, booleans and `None`.

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer.
    Int(i128),
    /// A float.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<PyValue>),
    /// A `tuple`.
    Tuple(Vec<PyValue>),
    /// A `dict` with string keys, in insertion order.
    Dict(Vec<(String, PyValue)>),
}

impl From<&str> for PyValue {
    fn from(s: &str) -> Self {
        PyValue::Str(s.to_string())
    }
}
impl From<String> for PyValue {
    fn from(s: String) -> Self {
        PyValue::Str(s)
    }
}
impl From<u64> for PyValue {
    fn from(n: u64) -> Self {
        PyValue::Int(n as i128)
    }
}
impl From<i64> for PyValue {
    fn from(n: i64) -> Self {
        PyValue::Int(n as i128)
    }
}
impl From<bool> for PyValue {
    fn from(b: bool) -> Self {
        PyValue::Bool(b)
    }
}
impl From<f64> for PyValue {
    fn from(x: f64) -> Self {
        PyValue::Float(x)
    }
}

/// Builds a `PyValue::Dict` from `key => value` pairs.
macro_rules! pydict {
    ($($k:expr => $v:expr),* $(,)?) => {
        $crate::export::pickle::PyValue::Dict(vec![$(($k.to_string(), $crate::export::pickle::PyValue::from($v))),*])
    };
}
pub(crate) use pydict;

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT1: u8 = b'K';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const EMPTY_TUPLE: u8 = b')';
const EMPTY_DICT: u8 = b'}';
const MARK: u8 = b'(';
const APPENDS: u8 = b'e';
const SETITEMS: u8 = b'u';
const TUPLE: u8 = b't';

/// Serialises `v` as a protocol-2 pickle, readable by Python's `pickle.load`.
///
/// ```
/// use oomguard_runtime::export::pickle::{to_pickle, PyValue};
/// let bytes = to_pickle(&PyValue::List(vec![PyValue::Int(1), PyValue::from("a")]));
/// assert_eq!(bytes[0], 0x80);
/// assert_eq!(*bytes.last().unwrap(), b'.');
/// ```
pub fn to_pickle(v: &PyValue) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write(&mut out, v);
    out.push(STOP);
    out
}

fn write(out: &mut Vec<u8>, v: &PyValue) {
    match v {
        PyValue::None => out.push(NONE),
        PyValue::Bool(true) => out.push(NEWTRUE),
        PyValue::Bool(false) => out.push(NEWFALSE),
        PyValue::Int(n) => write_int(out, *n),
        PyValue::Float(x) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&x.to_be_bytes());
        }
        PyValue::Str(s) => write_str(out, s),
        PyValue::List(items) => {
            out.push(EMPTY_LIST);
            // APPENDS in batches of 1000, as CPython does
            for chunk in items.chunks(1000) {
                out.push(MARK);
                for i in chunk {
                    write(out, i);
                }
                out.push(APPENDS);
            }
        }
        PyValue::Tuple(items) if items.is_empty() => out.push(EMPTY_TUPLE),
        PyValue::Tuple(items) => {
            out.push(MARK);
            for i in items {
                write(out, i);
            }
            out.push(TUPLE);
        }
        PyValue::Dict(items) => {
            out.push(EMPTY_DICT);
            for chunk in items.chunks(1000) {
                out.push(MARK);
                for (k, v) in chunk {
                    write_str(out, k);
                    write(out, v);
                }
                out.push(SETITEMS);
            }
        }
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(BINUNICODE);
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_int(out: &mut Vec<u8>, n: i128) {
    if (0..256).contains(&n) {
        out.extend_from_slice(&[BININT1, n as u8]);
    } else if i32::try_from(n).is_ok() {
        out.push(BININT);
        out.extend_from_slice(&(n as i32).to_le_bytes());
    } else {
        // LONG1: little-endian two's complement, shortest form
        let bytes = n.to_le_bytes();
        let mut len = 16;
        while len > 1 {
            let top = bytes[len - 1];
            let next_sign = bytes[len - 2] & 0x80;
            if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                len -= 1;
            } else {
                break;
            }
        }
        out.extend_from_slice(&[LONG1, len as u8]);
        out.extend_from_slice(&bytes[..len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_ints_in_the_shortest_form() {
        assert_eq!(to_pickle(&PyValue::Int(5)), vec![0x80, 2, b'K', 5, b'.']);
        assert_eq!(
            to_pickle(&PyValue::Int(-1)),
            vec![0x80, 2, b'J', 0xff, 0xff, 0xff, 0xff, b'.']
        );
        // 2^40: LONG1 with 6 bytes (the top byte keeps the sign bit clear)
        assert_eq!(
            to_pickle(&PyValue::Int(1 << 40)),
            vec![0x80, 2, 0x8a, 6, 0, 0, 0, 0, 0, 1, b'.']
        );
        // 2^47 needs a 7th byte so that it is not read as negative
        assert_eq!(
            to_pickle(&PyValue::Int(1 << 47)),
            vec![0x80, 2, 0x8a, 7, 0, 0, 0, 0, 0, 0x80, 0, b'.']
        );
    }

    #[test]
    fn encodes_containers() {
        let v = pydict! { "a" => 1u64, "b" => true };
        assert_eq!(
            to_pickle(&v),
            vec![
                0x80, 2, b'}', b'(', b'X', 1, 0, 0, 0, b'a', b'K', 1, b'X', 1, 0, 0, 0, b'b', 0x88,
                b'u', b'.'
            ]
        );
        let t = PyValue::Tuple(vec![PyValue::Int(0), PyValue::Int(0)]);
        assert_eq!(
            to_pickle(&t),
            vec![0x80, 2, b'(', b'K', 0, b'K', 0, b't', b'.']
        );
    }
}
