//! A small pickle virtual machine: enough of Python's pickle protocols 0–5 to decode data such as
//! PyTorch memory snapshots, without executing anything.
//!
//! Plain data (None, bools, ints, floats, strings, bytes, lists, tuples, dicts, sets) decodes to
//! [`Value`]s. Class references (`GLOBAL`, `STACK_GLOBAL`) and the objects built from them
//! (`REDUCE`, `NEWOBJ`, `BUILD`, `INST`, `OBJ`) decode to an opaque [`Value::Object`] naming the
//! class, so files holding objects of unknown classes still decode. Lists and dicts live in an
//! arena (`Heap`) so that memoized references alias as in Python, and cycles cannot leak.
//! Malformed or truncated input is an error naming the byte offset of the opcode; nothing panics
//! and no length read from the input is trusted before it is checked against the input's size.
//!
//! Hostile input (a snapshot is a pickle: anyone's file) is bounded in stack, time and memory:
//! - **No recursion anywhere.** Tuples live in the heap like lists, so a [`Value`] never owns
//!   another value and nothing (drop, clone, comparison, the snapshot reader) recurses: a 1 MB
//!   pickle of 10^6 nested tuples decodes in constant stack (it aborted with a stack overflow
//!   when tuples were `Rc<[Value]>`).
//! - **Memo references alias, never copy**: `BINGET` pushes the same heap id, so K references to
//!   a dict of N pairs cost K values, not K×N (the snapshot reader also reads each distinct
//!   entry dict once; see `snapshot.rs`).
//! - **A memory budget**: every value, heap object, string byte and memo slot is charged at its
//!   in-memory size, and decoding stops with an error past [`memory_budget`] (64 MiB + 16× the
//!   file). A 20 MB pickle of memoized empty lists, the worst ratio of any opcode, took 1.36 GB
//!   (68×) before; it now stops at the budget (see docs/RELIABILITY.md for the measured figures).
//!
//! Why not the `serde-pickle` crate: its decoder resolves a memo reference by cloning the memoized
//! value (all but the last reference), so a 180 KB snapshot whose 50,000 entries reference two
//! dicts of 10,000 pairs would materialize 500 million pairs (at least 32 GB at 64 bytes a pair)
//! where this VM holds 50,000 ids (it decodes that file in 0.15 s and 11 MB); its `Value` is recursive (nested tuples overflow the stack on drop); and it rejects the
//! class-building opcodes (`BUILD`, `NEWOBJ`, `INST`, `OBJ`) that snapshots of other tools carry,
//! where this VM keeps an opaque object. Hostile input, memo semantics and memory decided it.

use std::collections::HashMap;
use std::rc::Rc;

use crate::error::ReadError;

/// Index of a list or dict in a [`Heap`].
pub type ObjId = usize;

/// A decoded value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An int that fits 64 bits.
    Int(i64),
    /// An int that does not fit 64 bits (its value is not kept).
    BigInt,
    /// A float.
    Float(f64),
    /// A `str`.
    Str(Rc<str>),
    /// `bytes` or `bytearray`.
    Bytes(Rc<[u8]>),
    /// A `list` in the heap.
    List(ObjId),
    /// A `dict` in the heap.
    Dict(ObjId),
    /// A `tuple` in the heap (kept as a list, so that no value owns another: see the module docs).
    Tuple(ObjId),
    /// A `set` or `frozenset` in the heap (kept as a list).
    Set(ObjId),
    /// An object of a class this VM does not build (its `module.name`).
    Object(Rc<str>),
}

impl Value {
    /// The int, if this is one (bools count as 0/1, as in Python).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// A short name of the type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Tuple(_) => "tuple",
            Value::Set(_) => "set",
            Value::Object(_) => "object",
        }
    }
}

/// A list (also a tuple or a set) or a dict (dicts keep insertion order as pairs; keys need not be
/// hashable).
#[derive(Clone, Debug, PartialEq)]
pub enum HeapObj {
    /// A list (or tuple, or set).
    List(Vec<Value>),
    /// A dict.
    Dict(Vec<(Value, Value)>),
}

/// The lists and dicts of a decoded pickle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Heap {
    objs: Vec<HeapObj>,
}

impl Heap {
    fn alloc(&mut self, o: HeapObj) -> ObjId {
        self.objs.push(o);
        self.objs.len() - 1
    }
    /// The items of a list, tuple or set value (`None` for anything else).
    pub fn list(&self, v: &Value) -> Option<&[Value]> {
        match v {
            Value::List(id) | Value::Set(id) | Value::Tuple(id) => match self.objs.get(*id) {
                Some(HeapObj::List(items)) => Some(items),
                _ => None,
            },
            _ => None,
        }
    }
    /// Number of lists, tuples, sets and dicts.
    pub fn len(&self) -> usize {
        self.objs.len()
    }
    /// Whether the pickle held no list, tuple, set or dict.
    pub fn is_empty(&self) -> bool {
        self.objs.is_empty()
    }
    /// The pairs of a dict value (`None` for anything else).
    pub fn dict(&self, v: &Value) -> Option<&[(Value, Value)]> {
        match v {
            Value::Dict(id) => match self.objs.get(*id) {
                Some(HeapObj::Dict(pairs)) => Some(pairs),
                _ => None,
            },
            _ => None,
        }
    }
    /// The value under the string key `key` of a dict value (the last one, as Python keeps).
    pub fn get<'a>(&'a self, v: &Value, key: &str) -> Option<&'a Value> {
        self.dict(v)?
            .iter()
            .rev()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }
}

/// A decoded pickle: the top value and the heap its lists and dicts live in.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    /// The value the pickle stopped with.
    pub value: Value,
    /// Lists and dicts.
    pub heap: Heap,
    /// Bytes of memory the decoder charged against its budget (an estimate of what it
    /// allocated: values, objects, strings, memo slots).
    pub charged: usize,
}

enum Slot {
    V(Value),
    Mark,
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    op_at: usize,
    stack: Vec<Slot>,
    /// Memo slots 0..n as pickle writes them (`MEMOIZE`, and `BINPUT` counting up): a vector,
    /// 24 bytes a slot instead of a hash map's ~50.
    memo: Vec<Value>,
    /// Memo slots put out of order, far beyond the dense ones (never by CPython's pickler).
    memo_sparse: HashMap<u64, Value>,
    heap: Heap,
    /// Bytes charged so far against `budget`.
    charged: usize,
    budget: usize,
}

/// Most bytes of memory [`decode`] may use for a pickle of `len` bytes: 64 MiB plus 16 times the
/// file. Real PyTorch snapshots need about 7× (the resnet50 snapshot of `traces/`: 570 KB,
/// charged 4.0 MB); only hostile files (long runs of 1- and 2-byte opcodes that each build a
/// 24–56 byte object) come near the limit.
pub fn memory_budget(len: usize) -> usize {
    (64 << 20) + len.saturating_mul(16)
}

/// Bytes charged for one value (on the stack, in a container or in the memo).
const VALUE: usize = std::mem::size_of::<Value>();
/// Bytes charged for one list, tuple, set or dict (beyond its items).
const OBJ: usize = std::mem::size_of::<HeapObj>();

/// Decodes a pickle.
///
/// ```
/// use oomguard_cli::pickle::{decode, Value};
/// // pickle.dumps({'a': [1, 2]}, protocol=2)
/// let d = decode(b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01]q\x02(K\x01K\x02es.").unwrap();
/// let list = d.heap.get(&d.value, "a").unwrap();
/// assert_eq!(d.heap.list(list).unwrap(), &[Value::Int(1), Value::Int(2)]);
/// assert!(decode(b"\x80\x02}q\x00X\x01\x00").unwrap_err().to_string().contains("byte offset"));
/// ```
pub fn decode(data: &[u8]) -> Result<Decoded, ReadError> {
    decode_with_budget(data, memory_budget(data.len()))
}

/// [`decode`] with a memory budget of `budget` bytes instead of [`memory_budget`]'s: past it,
/// decoding stops with an error naming the offset.
///
/// ```
/// use oomguard_cli::pickle::decode_with_budget;
/// // a list of 1,000 empty lists: fine with 1 MB, refused with 10 kB
/// let mut p = b"\x80\x04(".to_vec();
/// p.extend(std::iter::repeat_n(b']', 1000));
/// p.extend(b"l.");
/// assert!(decode_with_budget(&p, 1 << 20).is_ok());
/// let e = decode_with_budget(&p, 10_000).unwrap_err().to_string();
/// assert!(e.contains("more than 10000 bytes of memory"), "{e}");
/// ```
pub fn decode_with_budget(data: &[u8], budget: usize) -> Result<Decoded, ReadError> {
    let mut vm = Vm {
        data,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        memo: Vec::new(),
        memo_sparse: HashMap::new(),
        heap: Heap::default(),
        charged: 0,
        budget,
    };
    let value = vm.run()?;
    Ok(Decoded {
        value,
        heap: vm.heap,
        charged: vm.charged,
    })
}

impl<'a> Vm<'a> {
    fn err(&self, message: impl Into<String>) -> ReadError {
        ReadError::Pickle {
            offset: self.op_at,
            message: message.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let data: &'a [u8] = self.data;
        if data.len() - self.pos < n {
            return Err(self.err(format!(
                "truncated: needs {n} more bytes, {} left",
                data.len() - self.pos
            )));
        }
        let s = &data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.take(1)?[0])
    }
    fn le<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let mut b = [0u8; N];
        b.copy_from_slice(self.take(N)?);
        Ok(b)
    }
    fn len_from(&mut self, n: u64) -> Result<usize, ReadError> {
        let left = (self.data.len() - self.pos) as u64;
        if n > left {
            return Err(self.err(format!("truncated: length {n} but {left} bytes left")));
        }
        Ok(n as usize)
    }
    fn line(&mut self) -> Result<&'a [u8], ReadError> {
        let data: &'a [u8] = self.data;
        let rest = &data[self.pos..];
        let Some(i) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.err("truncated: line without newline"));
        };
        self.pos += i + 1;
        Ok(&rest[..i])
    }

    /// Pushes `v`, charging the value and, when it was just made (not a memo reference), the
    /// bytes of its string.
    fn push(&mut self, v: Value) {
        self.charged += VALUE
            + match &v {
                Value::Str(s) | Value::Object(s) if Rc::strong_count(s) == 1 => s.len() + 16,
                Value::Bytes(b) if Rc::strong_count(b) == 1 => b.len() + 16,
                _ => 0,
            };
        self.stack.push(Slot::V(v));
    }
    /// A new list, tuple, set or dict in the heap, charged.
    fn new_obj(&mut self, o: HeapObj) -> ObjId {
        self.charged += OBJ;
        self.heap.alloc(o)
    }
    fn pop(&mut self) -> Result<Value, ReadError> {
        match self.stack.pop() {
            Some(Slot::V(v)) => Ok(v),
            Some(Slot::Mark) => Err(self.err("expected a value, found a mark")),
            None => Err(self.err("stack underflow")),
        }
    }
    fn top(&self) -> Result<&Value, ReadError> {
        match self.stack.last() {
            Some(Slot::V(v)) => Ok(v),
            _ => Err(self.err("stack underflow")),
        }
    }
    /// Pops everything down to the last mark (and the mark).
    fn pop_mark(&mut self) -> Result<Vec<Value>, ReadError> {
        let Some(m) = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)) else {
            return Err(self.err("no mark on the stack"));
        };
        let items = self
            .stack
            .drain(m..)
            .skip(1)
            .filter_map(|s| match s {
                Slot::V(v) => Some(v),
                Slot::Mark => None,
            })
            .collect();
        Ok(items)
    }

    fn str_value(&self, b: &[u8]) -> Result<Value, ReadError> {
        std::str::from_utf8(b)
            .map(|s| Value::Str(Rc::from(s)))
            .map_err(|_| self.err("string is not valid UTF-8"))
    }

    fn long(&self, b: &[u8]) -> Value {
        // little-endian two's complement
        if b.is_empty() {
            return Value::Int(0);
        }
        if b.len() > 8 {
            let neg = b[b.len() - 1] & 0x80 != 0;
            let fill = if neg { 0xff } else { 0 };
            if b[8..].iter().any(|&x| x != fill) || ((b[7] & 0x80 != 0) != neg) {
                return Value::BigInt;
            }
        }
        let n = b.len().min(8);
        let neg = b[n - 1] & 0x80 != 0;
        let mut buf = if neg { [0xffu8; 8] } else { [0u8; 8] };
        buf[..n].copy_from_slice(&b[..n]);
        Value::Int(i64::from_le_bytes(buf))
    }

    fn append_to(&mut self, target: &Value, items: Vec<Value>) -> Result<(), ReadError> {
        match target {
            Value::List(id) | Value::Set(id) => match self.heap.objs.get_mut(*id) {
                Some(HeapObj::List(l)) => {
                    l.extend(items);
                    Ok(())
                }
                _ => Err(self.err("append to a non-list")),
            },
            // Appending to an object: a list subclass we do not model; drop the items.
            Value::Object(_) => Ok(()),
            other => Err(self.err(format!("append to a {}", other.type_name()))),
        }
    }

    fn setitems(&mut self, target: &Value, items: Vec<Value>) -> Result<(), ReadError> {
        if items.len() % 2 != 0 {
            return Err(self.err("odd number of items for a dict"));
        }
        match target {
            Value::Dict(id) => match self.heap.objs.get_mut(*id) {
                Some(HeapObj::Dict(d)) => {
                    d.reserve(items.len() / 2);
                    let mut it = items.into_iter();
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        d.push((k, v));
                    }
                    Ok(())
                }
                _ => Err(self.err("setitem on a non-dict")),
            },
            Value::Object(_) => Ok(()),
            other => Err(self.err(format!("setitem on a {}", other.type_name()))),
        }
    }

    fn memo_get(&self, idx: u64) -> Result<Value, ReadError> {
        let dense = usize::try_from(idx).ok().and_then(|i| self.memo.get(i));
        dense
            .or_else(|| self.memo_sparse.get(&idx))
            .cloned()
            .ok_or_else(|| self.err(format!("memo key {idx} not defined")))
    }
    fn memo_put(&mut self, idx: u64) -> Result<(), ReadError> {
        let v = self.top()?.clone();
        self.charged += VALUE + 8;
        match usize::try_from(idx) {
            Ok(i) if i < self.memo.len() => self.memo[i] = v,
            Ok(i) if i == self.memo.len() => {
                // a key put sparse before the dense run reached it moves here: no key is in
                // both, so `memo_len` counts each once
                self.memo_sparse.remove(&idx);
                self.memo.push(v);
            }
            _ => {
                self.memo_sparse.insert(idx, v);
            }
        }
        Ok(())
    }
    /// The index `MEMOIZE` stores at: the number of memo entries so far, as in CPython.
    fn memo_len(&self) -> u64 {
        (self.memo.len() + self.memo_sparse.len()) as u64
    }

    fn global_name(&self, module: &[u8], name: &[u8]) -> Value {
        let m = String::from_utf8_lossy(module);
        let n = String::from_utf8_lossy(name);
        Value::Object(Rc::from(format!("{}.{}", m.trim(), n.trim()).as_str()))
    }

    fn run(&mut self) -> Result<Value, ReadError> {
        loop {
            self.op_at = self.pos;
            if self.charged > self.budget {
                return Err(self.err(format!(
                    "decoding needs more than {} bytes of memory ({} MiB), the reader's budget \
                     for this file: not a memory snapshot PyTorch writes",
                    self.budget,
                    self.budget >> 20
                )));
            }
            if self.pos >= self.data.len() {
                return Err(self.err("truncated: no STOP opcode"));
            }
            let op = self.u8()?;
            match op {
                b'.' => {
                    // STOP
                    return self.pop();
                }
                b'(' => {
                    self.charged += std::mem::size_of::<Slot>();
                    self.stack.push(Slot::Mark);
                }
                b'0' => {
                    self.pop_any()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v);
                }
                0x80 => {
                    let p = self.u8()?;
                    if p > 5 {
                        return Err(self.err(format!("unsupported pickle protocol {p}")));
                    }
                }
                0x95 => {
                    // FRAME: a hint only
                    self.take(8)?;
                }
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'K' => {
                    let b = self.u8()?;
                    self.push(Value::Int(b as i64));
                }
                b'M' => {
                    let b = self.le::<2>()?;
                    self.push(Value::Int(u16::from_le_bytes(b) as i64));
                }
                b'J' => {
                    let b = self.le::<4>()?;
                    self.push(Value::Int(i32::from_le_bytes(b) as i64));
                }
                0x8a => {
                    let n = self.u8()? as u64;
                    let n = self.len_from(n)?;
                    let b = self.take(n)?;
                    let v = self.long(b);
                    self.push(v);
                }
                0x8b => {
                    let n = u32::from_le_bytes(self.le::<4>()?) as u64;
                    let n = self.len_from(n)?;
                    let b = self.take(n)?;
                    let v = self.long(b);
                    self.push(v);
                }
                b'I' | b'L' => {
                    // as CPython's C unpickler: `I` is C's strtol in base 0 (so "010" is 8),
                    // else Python's int(text, 0); a two-character 0 or 1 is a bool. `L`
                    // drops one trailing "L" and reads int(text, 0).
                    let line = self.line()?;
                    let s = String::from_utf8_lossy(line);
                    let (s, strtol) = match op {
                        b'L' => (s.strip_suffix('L').unwrap_or(&s), None),
                        _ => (&*s, c_strtol_base0(&s)),
                    };
                    let v = match strtol.map(Some).or_else(|| python_int(s.trim())) {
                        Some(Some(i @ (0 | 1))) if strtol.is_some() && line.len() == 2 => {
                            Value::Bool(i == 1)
                        }
                        Some(Some(i)) => Value::Int(i),
                        Some(None) => Value::BigInt,
                        None => return Err(self.err(format!("bad integer {:?}", s.trim()))),
                    };
                    self.push(v);
                }
                b'F' => {
                    let line = self.line()?;
                    let s = String::from_utf8_lossy(line);
                    let f: f64 = s
                        .trim()
                        .parse()
                        .map_err(|_| self.err(format!("bad float {:?}", s.trim())))?;
                    self.push(Value::Float(f));
                }
                b'G' => {
                    let b = self.le::<8>()?;
                    self.push(Value::Float(f64::from_be_bytes(b)));
                }
                b'S' => {
                    // a quoted repr, decoded as CPython does (one pair of matching quotes,
                    // then Python's string escapes)
                    let line = self.line()?;
                    let s = quoted_string(line)
                        .ok_or_else(|| self.err("the STRING opcode argument must be quoted"))?;
                    self.push(Value::Str(Rc::from(s.as_str())));
                }
                b'V' => {
                    // raw-unicode-escape: Latin-1 bytes, with \uXXXX and \UXXXXXXXX escapes
                    let line = self.line()?;
                    let s = raw_unicode_escape(line)
                        .ok_or_else(|| self.err("bad \\u escape in a UNICODE string"))?;
                    self.push(Value::Str(Rc::from(s.as_str())));
                }
                b'T' | b'X' => {
                    let n = u32::from_le_bytes(self.le::<4>()?) as u64;
                    let n = self.len_from(n)?;
                    let b = self.take(n)?;
                    let v = if op == b'X' {
                        self.str_value(b)?
                    } else {
                        Value::Str(Rc::from(String::from_utf8_lossy(b).as_ref()))
                    };
                    self.push(v);
                }
                b'U' | 0x8c => {
                    let n = self.u8()? as usize;
                    let b = self.take(n)?;
                    let v = if op == 0x8c {
                        self.str_value(b)?
                    } else {
                        Value::Str(Rc::from(String::from_utf8_lossy(b).as_ref()))
                    };
                    self.push(v);
                }
                0x8d => {
                    let n = u64::from_le_bytes(self.le::<8>()?);
                    let n = self.len_from(n)?;
                    let b = self.take(n)?;
                    let v = self.str_value(b)?;
                    self.push(v);
                }
                b'C' => {
                    let n = self.u8()? as usize;
                    let b = self.take(n)?;
                    self.push(Value::Bytes(Rc::from(b)));
                }
                b'B' => {
                    let n = u32::from_le_bytes(self.le::<4>()?) as u64;
                    let n = self.len_from(n)?;
                    let b = self.take(n)?;
                    self.push(Value::Bytes(Rc::from(b)));
                }
                0x8e | 0x96 => {
                    let n = u64::from_le_bytes(self.le::<8>()?);
                    let n = self.len_from(n)?;
                    let b = self.take(n)?;
                    self.push(Value::Bytes(Rc::from(b)));
                }
                0x97 => return Err(self.err("out-of-band buffers (NEXT_BUFFER) are not supported")),
                0x98 => {} // READONLY_BUFFER: no-op on the top value
                b']' => {
                    let id = self.new_obj(HeapObj::List(Vec::new()));
                    self.push(Value::List(id));
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    let id = self.new_obj(HeapObj::List(items));
                    self.push(Value::List(id));
                }
                b'}' => {
                    let id = self.new_obj(HeapObj::Dict(Vec::new()));
                    self.push(Value::Dict(id));
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let id = self.new_obj(HeapObj::Dict(Vec::new()));
                    self.setitems(&Value::Dict(id), items)?;
                    self.push(Value::Dict(id));
                }
                0x8f => {
                    let id = self.new_obj(HeapObj::List(Vec::new()));
                    self.push(Value::Set(id));
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    let id = self.new_obj(HeapObj::List(items));
                    self.push(Value::Set(id));
                }
                0x90 => {
                    let items = self.pop_mark()?;
                    let target = self.top()?.clone();
                    self.append_to(&target, items)?;
                }
                b')' => {
                    let id = self.new_obj(HeapObj::List(Vec::new()));
                    self.push(Value::Tuple(id));
                }
                b't' => {
                    let items = self.pop_mark()?;
                    let id = self.new_obj(HeapObj::List(items));
                    self.push(Value::Tuple(id));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    let id = self.new_obj(HeapObj::List(items));
                    self.push(Value::Tuple(id));
                }
                b'a' => {
                    let v = self.pop()?;
                    let target = self.top()?.clone();
                    self.append_to(&target, vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let target = self.top()?.clone();
                    self.append_to(&target, items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let target = self.top()?.clone();
                    self.setitems(&target, vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let target = self.top()?.clone();
                    self.setitems(&target, items)?;
                }
                b'g' => {
                    let line = self.line()?;
                    let idx = parse_memo_index(line).ok_or_else(|| self.err("bad memo index"))?;
                    let v = self.memo_get(idx)?;
                    self.push(v);
                }
                b'h' => {
                    let idx = self.u8()? as u64;
                    let v = self.memo_get(idx)?;
                    self.push(v);
                }
                b'j' => {
                    let idx = u32::from_le_bytes(self.le::<4>()?) as u64;
                    let v = self.memo_get(idx)?;
                    self.push(v);
                }
                b'p' => {
                    let line = self.line()?;
                    let idx = parse_memo_index(line).ok_or_else(|| self.err("bad memo index"))?;
                    self.memo_put(idx)?;
                }
                b'q' => {
                    let idx = self.u8()? as u64;
                    self.memo_put(idx)?;
                }
                b'r' => {
                    let idx = u32::from_le_bytes(self.le::<4>()?) as u64;
                    self.memo_put(idx)?;
                }
                0x94 => {
                    // CPython's MEMOIZE stores at len(memo).
                    let idx = self.memo_len();
                    self.memo_put(idx)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let v = self.global_name(module, name);
                    self.push(v);
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Some(m), Some(n)) = (module.as_str(), name.as_str()) else {
                        return Err(self.err("STACK_GLOBAL needs two strings"));
                    };
                    let v = self.global_name(m.as_bytes(), n.as_bytes());
                    self.push(v);
                }
                b'R' | 0x81 => {
                    // REDUCE / NEWOBJ: callable(args) -> an opaque object of that class
                    let _args = self.pop()?;
                    let class = self.pop()?;
                    let v = object_of(&class);
                    self.push(v);
                }
                0x92 => {
                    // NEWOBJ_EX: cls, args, kwargs
                    let _kwargs = self.pop()?;
                    let _args = self.pop()?;
                    let class = self.pop()?;
                    let v = object_of(&class);
                    self.push(v);
                }
                b'b' => {
                    // BUILD: set state on the object; the object stays
                    let _state = self.pop()?;
                    self.top()?;
                }
                b'i' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.pop_mark()?;
                    let v = self.global_name(module, name);
                    self.push(v);
                }
                b'o' => {
                    let mut items = self.pop_mark()?;
                    if items.is_empty() {
                        return Err(self.err("OBJ without a class"));
                    }
                    let class = items.remove(0);
                    self.push(object_of(&class));
                }
                b'P' => {
                    let line = self.line()?;
                    let id = String::from_utf8_lossy(line).to_string();
                    self.push(Value::Object(Rc::from(format!("persistent:{id}").as_str())));
                }
                b'Q' => {
                    self.pop()?;
                    self.push(Value::Object(Rc::from("persistent")));
                }
                0x82 => {
                    self.u8()?;
                    self.push(Value::Object(Rc::from("extension")));
                }
                0x83 => {
                    self.take(2)?;
                    self.push(Value::Object(Rc::from("extension")));
                }
                0x84 => {
                    self.take(4)?;
                    self.push(Value::Object(Rc::from("extension")));
                }
                other => return Err(self.err(format!("unknown opcode {other:#04x}"))),
            }
        }
    }

    fn pop_any(&mut self) -> Result<(), ReadError> {
        match self.stack.pop() {
            Some(_) => Ok(()),
            None => Err(self.err("stack underflow")),
        }
    }
}

fn object_of(class: &Value) -> Value {
    match class {
        Value::Object(name) => Value::Object(name.clone()),
        _ => Value::Object(Rc::from("?")),
    }
}

/// C's `strtol(s, &end, 0)` when it reads all of `s` into 64 bits: leading white space, a
/// sign, then `0x` and hex digits, `0` and octal digits, or decimal digits. `None` otherwise
/// (CPython then reads the text as Python's `int(s, 0)`).
fn c_strtol_base0(s: &str) -> Option<i64> {
    let t = s.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (negative, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    // (bytes: the text may hold any character, and a `str` slice must not split one)
    let hex = matches!(t.as_bytes(), [b'0', b'x' | b'X', h, ..] if h.is_ascii_hexdigit());
    let (radix, digits) = if hex {
        (16, &t[2..])
    } else if t.starts_with('0') {
        (8, t)
    } else {
        (10, t)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let v = i128::from_str_radix(digits, radix).ok()?;
    i64::try_from(if negative { -v } else { v }).ok()
}

/// `int(s, 0)` as Python reads it: an optional sign, a `0x`/`0o`/`0b` prefix or decimal
/// digits (no leading zero but for zero itself), single underscores between digits. `None`:
/// not an integer; `Some(None)`: one outside 64 bits.
fn python_int(s: &str) -> Option<Option<i64>> {
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let prefixed = |p: &str| {
        s.get(..2)
            .filter(|h| h.eq_ignore_ascii_case(p))
            .map(|_| &s[2..])
    };
    let (radix, digits) = if let Some(d) = prefixed("0x") {
        (16, d.strip_prefix('_').unwrap_or(d))
    } else if let Some(d) = prefixed("0o") {
        (8, d.strip_prefix('_').unwrap_or(d))
    } else if let Some(d) = prefixed("0b") {
        (2, d.strip_prefix('_').unwrap_or(d))
    } else {
        (10, s)
    };
    let well_formed = !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.chars().all(|c| c == '_' || c.is_digit(radix))
        && !(radix == 10
            && digits.starts_with('0')
            && digits.bytes().any(|b| b != b'0' && b != b'_'));
    if !well_formed {
        return None;
    }
    let plain: String = digits.chars().filter(|&c| c != '_').collect();
    let v = i128::from_str_radix(&plain, radix).ok();
    Some(v.and_then(|v| i64::try_from(if negative { -v } else { v }).ok()))
}

/// A protocol-0 `STRING` argument as CPython reads it: one pair of matching quotes around
/// the text, then `codecs.escape_decode` (`\\`, `\'`, `\n`, `\xhh`, octal, ...); `None`
/// when it is not quoted or an `\x` escape is bad. Bytes outside ASCII are read as UTF-8.
fn quoted_string(line: &[u8]) -> Option<String> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let (&q, rest) = line.split_first()?;
    let body = rest.strip_suffix(&[q])?;
    if q != b'\'' && q != b'"' {
        return None;
    }
    let mut out = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        let c = body[i];
        i += 1;
        if c != b'\\' {
            out.push(c);
            continue;
        }
        let Some(&e) = body.get(i) else {
            return None; // a trailing backslash: Python's "\\ at end of string"
        };
        i += 1;
        match e {
            b'\n' => {}
            b'\\' | b'\'' | b'"' => out.push(e),
            b'a' => out.push(7),
            b'b' => out.push(8),
            b'f' => out.push(12),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(11),
            b'0'..=b'7' => {
                let mut v = u32::from(e - b'0');
                for _ in 0..2 {
                    match body.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            v = v * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push((v & 0xff) as u8);
            }
            b'x' => {
                let hex = body.get(i..i + 2)?;
                let v = u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
                out.push(v);
                i += 2;
            }
            _ => out.extend([b'\\', e]),
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// A protocol-0 `UNICODE` argument: raw-unicode-escape (each byte a Latin-1 character, but
/// `\uXXXX` and `\UXXXXXXXX`, after an odd number of backslashes, are code points); `None` on
/// a bad escape.
fn raw_unicode_escape(line: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < line.len() {
        let c = line[i];
        if c == b'\\' {
            // a run of backslashes: an escape only after an odd count
            let run = line[i..].iter().take_while(|&&b| b == b'\\').count();
            let at = i + run;
            let width = match line.get(at) {
                Some(b'u') if run % 2 == 1 => 4,
                Some(b'U') if run % 2 == 1 => 8,
                _ => 0,
            };
            if width == 0 {
                out.extend(std::iter::repeat_n('\\', run));
                i = at;
                continue;
            }
            out.extend(std::iter::repeat_n('\\', run - 1));
            let hex = std::str::from_utf8(line.get(at + 1..at + 1 + width)?).ok()?;
            out.push(char::from_u32(u32::from_str_radix(hex, 16).ok()?)?);
            i = at + 1 + width;
        } else {
            out.push(char::from(c));
            i += 1;
        }
    }
    Some(out)
}

fn parse_memo_index(line: &[u8]) -> Option<u64> {
    std::str::from_utf8(line).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_protocol_0_and_objects() {
        // pickle.dumps({'x': (1, 2.5, None, True)}, protocol=0)
        let p0 = b"(dp0\nVx\np1\n(I1\nF2.5\nNI01\ntp2\ns.";
        let d = decode(p0).unwrap();
        let t = d.heap.get(&d.value, "x").unwrap();
        assert_eq!(
            d.heap.list(t).unwrap(),
            &[
                Value::Int(1),
                Value::Float(2.5),
                Value::None,
                Value::Bool(true)
            ]
        );
        // collections.OrderedDict() reduced: GLOBAL + REDUCE + BUILD, protocol 2
        let obj = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01}b.";
        let d = decode(obj).unwrap();
        assert_eq!(d.value, Value::Object(Rc::from("collections.OrderedDict")));
    }

    #[test]
    fn protocol_0_strings_ending_in_multibyte_chars() {
        // Found by the garbage fuzz test: stripping quotes must respect char boundaries. (An
        // unquoted argument was read as its text; CPython refuses it, and so does this now.)
        let e = decode("Sab\u{146}\n.".as_bytes()).unwrap_err();
        assert!(e.to_string().contains("must be quoted"), "{e}");
        let d = decode("S'ab\u{146}'\n.".as_bytes()).unwrap();
        assert_eq!(d.value, Value::Str(Rc::from("ab\u{146}")));
        let d = decode(b"S'x'\n.").unwrap();
        assert_eq!(d.value, Value::Str(Rc::from("x")));
    }

    #[test]
    fn memo_aliases_lists() {
        // l = []; pickle.dumps([l, l]) then appending through the memo shares the list
        let p = b"\x80\x04]\x94(]\x94h\x01e.";
        let d = decode(p).unwrap();
        let outer = d.heap.list(&d.value).unwrap();
        assert_eq!(outer.len(), 2);
        assert_eq!(outer[0], outer[1]);
    }

    /// Protocol-0 strings and integers as CPython 3 reads them (the expected values are
    /// `pickle.loads`'s on each input). Before: `S` stripped every quote at both ends and kept
    /// escapes, `V` read UTF-8 and kept `\uXXXX`, `I` read only decimal digits.
    #[test]
    fn protocol_0_strings_and_integers_read_as_cpython_reads_them() {
        let text = |p: &[u8]| match decode(p) {
            Ok(Decoded {
                value: Value::Str(s),
                ..
            }) => Ok(s.to_string()),
            Ok(d) => Err(format!("{:?}", d.value)),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(text(b"S'alloc'\n.").unwrap(), "alloc");
        assert_eq!(text(b"S\"alloc'\"\n.").unwrap(), "alloc'");
        assert_eq!(text(b"S'\\x61lloc'\n.").unwrap(), "alloc");
        assert_eq!(text(b"S'a\\\\b\\n\\t\\101'\n.").unwrap(), "a\\b\n\tA");
        assert_eq!(text(b"S'a\\qb'\n.").unwrap(), "a\\qb");
        for unquoted in [&b"Salloc\n."[..], b"S'alloc\"\n.", b"S'\n."] {
            let e = text(unquoted).unwrap_err();
            assert!(e.contains("must be quoted"), "{e}");
        }
        assert_eq!(
            text(b"VC:\\u005cpath\\u005cx.py\np0\n.").unwrap(),
            "C:\\path\\x.py"
        );
        assert_eq!(text(b"V\xe9 \xfc\np0\n.").unwrap(), "\u{e9} \u{fc}");
        assert_eq!(text(b"Va\\u1234b\np0\n.").unwrap(), "a\u{1234}b");
        assert_eq!(text(b"V\\u005cu0041\np0\n.").unwrap(), "\\u0041");

        let int = |p: &[u8]| decode(p).map(|d| d.value).map_err(|e| e.to_string());
        for (p, v) in [
            (&b"I1_000\n."[..], Value::Int(1000)),
            (b"I0x1f\n.", Value::Int(31)),
            (b"I010\n.", Value::Int(8)),
            (b"I+5\n.", Value::Int(5)),
            (b"I 7 \n.", Value::Int(7)),
            (b"I0_0\n.", Value::Int(0)),
            (b"I0b_1\n.", Value::Int(1)),
            (b"I-0\n.", Value::Bool(false)),
            (b"I00\n.", Value::Bool(false)),
            (b"I01\n.", Value::Bool(true)),
            (b"I 1\n.", Value::Bool(true)),
            (b"I1 \n.", Value::Int(1)),
            (b"L00L\n.", Value::Int(0)),
            (b"L99999999999999999999L\n.", Value::BigInt),
        ] {
            assert_eq!(int(p), Ok(v), "{}", String::from_utf8_lossy(p));
        }
        // found by the garbage fuzz test: "0" then a character of two bytes panicked (a slice
        // through the character)
        for bad in [
            &b"I1__0\n."[..],
            b"I_1\n.",
            b"I08\n.",
            b"L010L\n.",
            "I0\u{e9}\n.".as_bytes(),
            "I-0\u{e9}\n.".as_bytes(),
            "L0\u{e9}L\n.".as_bytes(),
        ] {
            let e = int(bad).unwrap_err();
            assert!(e.contains("bad integer"), "{e}");
        }
    }

    /// A key put sparse (past the dense run) and later reached by the dense run was counted
    /// twice, so `MEMOIZE` stored at the wrong index (CPython: `BINPUT 1, BINPUT 4, BINPUT 0,
    /// BINPUT 1, MEMOIZE` fills keys 0, 1, 4 and then 3).
    #[test]
    fn a_memo_key_put_twice_counts_once() {
        // 7 BINPUT 1; 8 BINPUT 4; 9 BINPUT 0; 9 BINPUT 1; 5 MEMOIZE (key 3); BINGET 4
        let p = b"\x80\x04K\x07q\x01K\x08q\x04K\x09q\x00q\x01K\x05\x94h\x04.";
        assert_eq!(decode(p).unwrap().value, Value::Int(8));
        let p = b"\x80\x04K\x07q\x01K\x08q\x04K\x09q\x00q\x01K\x05\x94h\x03.";
        assert_eq!(decode(p).unwrap().value, Value::Int(5));
    }

    #[test]
    fn big_and_negative_longs() {
        let d = decode(b"\x80\x02\x8a\x02\xff\xff.").unwrap();
        assert_eq!(d.value, Value::Int(-1));
        let d = decode(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.").unwrap();
        assert_eq!(d.value, Value::BigInt);
        let d = decode(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.").unwrap();
        assert_eq!(d.value, Value::BigInt);
        let d = decode(b"\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80.").unwrap();
        assert_eq!(d.value, Value::Int(i64::MIN));
    }

    #[test]
    fn errors_name_the_offset() {
        let e = decode(b"\x80\x04]\x94(K\x01").unwrap_err().to_string();
        assert_eq!(e, "pickle byte offset 7: truncated: no STOP opcode");
        let e = decode(b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("pickle byte offset 2: truncated: length"),
            "{e}"
        );
        let e = decode(b"\x80\x04h\x05.").unwrap_err().to_string();
        assert_eq!(e, "pickle byte offset 2: memo key 5 not defined");
        let e = decode(b"\x80\x04a.").unwrap_err().to_string();
        assert_eq!(e, "pickle byte offset 2: stack underflow");
        let e = decode(b"\x80\x04\xff.").unwrap_err().to_string();
        assert_eq!(e, "pickle byte offset 2: unknown opcode 0xff");
        let e = decode(b"").unwrap_err().to_string();
        assert_eq!(e, "pickle byte offset 0: truncated: no STOP opcode");
    }
}
