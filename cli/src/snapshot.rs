//! PyTorch memory snapshots (`torch.cuda.memory._snapshot()` / `_dump_snapshot`) to events.
//!
//! The snapshot's `device_traces` hold, per device, the allocator's history: `alloc`,
//! `free_requested` (the program released the tensor), `free_completed` (the memory became
//! reusable, after other streams' work), `segment_alloc` / `segment_free` / `segment_map` /
//! `segment_unmap` (PyTorch's own device calls), `snapshot` and `oom`. The program's events are
//! `alloc` and the first of `free_requested` / `free_completed` (or `free`, of older versions) for
//! each address; PyTorch's segment actions describe PyTorch's allocator, not the program, and are
//! only counted.

use std::collections::HashMap;

use crate::error::ReadError;
use crate::event::{Event, Trace, TraceFormat};
use crate::pickle::{decode, Heap, ObjId, Value};

/// Reads a snapshot pickle: the trace of the first device that has one.
pub fn parse(data: &[u8]) -> Result<Trace, ReadError> {
    if data.is_empty() {
        return Err(ReadError::Empty);
    }
    let d = decode(data)?;
    let heap = &d.heap;
    let bad = |m: String| ReadError::Snapshot(m);
    if heap.dict(&d.value).is_none() {
        return Err(bad(format!(
            "the pickle holds a {}, not a dict",
            d.value.type_name()
        )));
    }
    let traces = heap
        .get(&d.value, "device_traces")
        .ok_or_else(|| bad("no `device_traces` key (was memory history recorded?)".into()))?;
    let devices = heap.list(traces).ok_or_else(|| {
        bad(format!(
            "`device_traces` is a {}, not a list",
            traces.type_name()
        ))
    })?;
    let mut notes = Vec::new();
    let non_empty: Vec<usize> = (0..devices.len())
        .filter(|&i| heap.list(&devices[i]).is_some_and(|l| !l.is_empty()))
        .collect();
    let Some(&dev) = non_empty.first() else {
        return Err(ReadError::NoEvents);
    };
    if non_empty.len() > 1 {
        notes.push(format!(
            "the snapshot has traces for devices {non_empty:?}; replaying device {dev}"
        ));
    }
    let entries = heap.list(&devices[dev]).unwrap_or(&[]);
    let mut t = convert(heap, entries, dev)?;
    notes.append(&mut t.notes);
    t.notes = notes;
    Ok(t)
}

fn field_u64(heap: &Heap, e: &Value, key: &str, at: &str) -> Result<u64, ReadError> {
    let v = heap
        .get(e, key)
        .ok_or_else(|| ReadError::Snapshot(format!("{at}: no `{key}`")))?;
    match v.as_int() {
        Some(i) if i >= 0 => Ok(i as u64),
        _ => Err(ReadError::Snapshot(format!(
            "{at}: `{key}` is not a non-negative 64-bit int"
        ))),
    }
}

/// What the replay needs of one trace entry.
#[derive(Clone, Copy)]
enum Entry<'a> {
    Alloc {
        addr: u64,
        size: u64,
        stream: u64,
        frames: Option<ObjId>,
    },
    Free {
        action: &'a str,
        addr: u64,
        stream: u64,
    },
    Segment,
    Oom,
    Other,
}

fn entry<'a>(heap: &'a Heap, e: &Value, at: &str) -> Result<Entry<'a>, ReadError> {
    let action = heap
        .get(e, "action")
        .and_then(Value::as_str)
        .ok_or_else(|| ReadError::Snapshot(format!("{at}: no string `action`")))?;
    let stream = || heap.get(e, "stream").and_then(Value::as_int).unwrap_or(0) as u64;
    Ok(match action {
        "alloc" => Entry::Alloc {
            addr: field_u64(heap, e, "addr", at)?,
            size: field_u64(heap, e, "size", at)?,
            stream: stream(),
            frames: match heap.get(e, "frames") {
                Some(Value::List(id)) | Some(Value::Tuple(id)) => Some(*id),
                _ => None,
            },
        },
        "free_requested" | "free_completed" | "free" => Entry::Free {
            action,
            addr: field_u64(heap, e, "addr", at)?,
            stream: stream(),
        },
        "segment_alloc" | "segment_free" | "segment_map" | "segment_unmap" => Entry::Segment,
        "oom" => Entry::Oom,
        _ => Entry::Other,
    })
}

/// Allocation sites, each stored once: by the frames list (PyTorch memoizes shared ones) and by
/// text.
#[derive(Default)]
struct Sites {
    by_list: HashMap<ObjId, Option<u32>>,
    /// Each frame dict's line, read once: a hostile file can point many frames lists at one
    /// frame dict of N pairs (each read of it scans N pairs).
    by_frame: HashMap<ObjId, String>,
    by_text: HashMap<String, u32>,
    text: Vec<String>,
    /// Bytes of site text kept so far (stored twice: by text and in order).
    kept: usize,
    /// The site that stands for every site past [`Sites::TEXT_BUDGET`].
    over_budget: Option<u32>,
}

impl Sites {
    /// Frames kept per site: the innermost ones say where; the rest is the framework.
    const MAX_FRAMES: usize = 8;
    /// Characters kept of a frame's function name and of its file name: one string shared by
    /// many frames through the memo costs the file its length once, but every site's text
    /// would hold it again (a 1 MB snapshot of 1 MB file names took 2.6 GB, then aborted).
    const MAX_FIELD: usize = 160;
    /// Bytes of site text kept in all; past it, new sites share one site that says so.
    const TEXT_BUDGET: usize = 64 << 20;

    fn site(&mut self, heap: &Heap, frames: ObjId) -> Option<u32> {
        if let Some(s) = self.by_list.get(&frames) {
            return *s;
        }
        let list = heap.list(&Value::List(frames)).unwrap_or(&[]);
        let mut text = String::new();
        for f in list.iter().take(Self::MAX_FRAMES) {
            if !text.is_empty() {
                text.push('\n');
            }
            let id = match f {
                Value::Dict(id) => Some(*id),
                _ => None,
            };
            if let Some(line) = id.and_then(|id| self.by_frame.get(&id)) {
                text.push_str(line);
                continue;
            }
            let name = clip(heap.get(f, "name").and_then(Value::as_str).unwrap_or(""));
            let file = heap.get(f, "filename").and_then(Value::as_str);
            let file = clip(file.unwrap_or("?"));
            let line = heap.get(f, "line").and_then(Value::as_int).unwrap_or(0);
            let line = if name.is_empty() {
                format!("{file}:{line}")
            } else {
                format!("{name} ({file}:{line})")
            };
            text.push_str(&line);
            if let Some(id) = id {
                self.by_frame.insert(id, line);
            }
        }
        if list.len() > Self::MAX_FRAMES {
            text.push_str(&format!(
                "\n… {} more frames",
                list.len() - Self::MAX_FRAMES
            ));
        }
        let site = (!text.is_empty()).then(|| self.keep(text));
        self.by_list.insert(frames, site);
        site
    }

    /// The index of the site `text`, stored once (or the shared one past the budget).
    fn keep(&mut self, text: String) -> u32 {
        if let Some(&i) = self.by_text.get(&text) {
            return i;
        }
        if self.kept + 2 * text.len() > Self::TEXT_BUDGET {
            let next = self.text.len() as u32;
            return *self.over_budget.get_or_insert_with(|| {
                self.text.push(format!(
                    "(site not kept: the snapshot's allocation sites passed {} MiB of text)",
                    Self::TEXT_BUDGET >> 20
                ));
                next
            });
        }
        self.kept += 2 * text.len();
        let next = self.text.len() as u32;
        self.by_text.insert(text.clone(), next);
        self.text.push(text);
        next
    }
}

/// `s` cut to [`Sites::MAX_FIELD`] characters, an ellipsis marking the cut.
fn clip(s: &str) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(Sites::MAX_FIELD) {
        None => s.into(),
        Some((end, _)) => format!("{}…", &s[..end]).into(),
    }
}

fn convert(heap: &Heap, entries: &[Value], dev: usize) -> Result<Trace, ReadError> {
    // Each distinct entry dict is read once: a hostile file can reference one dict of N pairs
    // K times through the memo (K + N bytes), and reading every reference scanned K×N pairs (a
    // 1.8 MB file took 74 s; now linear).
    let mut seen: HashMap<ObjId, Entry<'_>> = HashMap::new();
    let mut sites = Sites::default();
    let mut alloc_site = HashMap::new();
    let mut events = Vec::new();
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new(); // addr -> (id, bytes)
    let mut requested: HashMap<u64, ()> = HashMap::new(); // freed, awaiting free_completed
    let mut next_id = 0u64;
    let mut unknown_frees = 0u64;
    let mut segment_actions = 0u64;
    let mut ooms = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let parsed = match e {
            Value::Dict(id) => match seen.get(id) {
                Some(p) => *p,
                None => {
                    let p = entry(heap, e, &format!("device_traces[{dev}][{i}]"))?;
                    seen.insert(*id, p);
                    p
                }
            },
            _ => entry(heap, e, &format!("device_traces[{dev}][{i}]"))?,
        };
        match parsed {
            Entry::Alloc {
                addr,
                size,
                stream,
                frames,
            } => {
                if let Some(site) = frames.and_then(|f| sites.site(heap, f)) {
                    alloc_site.insert(next_id, site);
                }
                if live.contains_key(&addr) {
                    return Err(ReadError::Snapshot(format!(
                        "device_traces[{dev}][{i}]: alloc at {addr:#x}, which is already live"
                    )));
                }
                requested.remove(&addr);
                live.insert(addr, (next_id, size));
                events.push(Event::alloc(next_id, size, stream));
                next_id += 1;
            }
            Entry::Free {
                action,
                addr,
                stream,
            } => {
                if action == "free_completed" && requested.remove(&addr).is_some() {
                    continue;
                }
                match live.remove(&addr) {
                    Some((id, size)) => {
                        events.push(Event::free(id, size, stream));
                        if action == "free_requested" {
                            requested.insert(addr, ());
                        }
                    }
                    // Allocated before recording began (or the history's ring buffer dropped it).
                    None => unknown_frees += 1,
                }
            }
            Entry::Segment => segment_actions += 1,
            Entry::Oom => ooms += 1,
            Entry::Other => {}
        }
    }
    if events.is_empty() {
        return Err(ReadError::NoEvents);
    }
    let mut t = Trace::new(TraceFormat::PytorchSnapshot, events);
    t.sites = sites.text;
    t.alloc_site = alloc_site;
    if unknown_frees > 0 {
        t.notes.push(format!(
            "skipped {unknown_frees} frees of memory allocated before the history began"
        ));
    }
    if ooms > 0 {
        t.notes.push(format!(
            "PyTorch recorded {ooms} out-of-memory events in this run"
        ));
    }
    t.notes.push(format!(
        "PyTorch's allocator made {segment_actions} segment calls in the recorded run"
    ));
    Ok(t)
}
