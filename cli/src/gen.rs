//! Seeded, deterministic generators of varying-shape allocation traces, so that the allocator is
//! not tuned to a handful of recorded traces alone:
//! - [`GenKind::Training`]: a transformer training loop whose sequence length changes every step
//!   (activations, attention scores, gradients, optimizer state);
//! - [`GenKind::Inference`]: variable-batch generation with a key/value cache grown by
//!   reallocation (`torch.cat` style) while older requests' caches are still live.

use std::collections::HashMap;

use crate::event::{Event, Trace, TraceFormat};

/// Which workload to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GenKind {
    /// Training with a variable sequence length.
    Training,
    /// Inference with variable batches and growing key/value caches.
    Inference,
}

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenSpec {
    /// Workload.
    pub kind: GenKind,
    /// Seed: equal specs give equal traces.
    pub seed: u64,
    /// Training steps or inference requests.
    pub steps: u32,
    /// Transformer layers.
    pub layers: u32,
    /// Hidden width.
    pub hidden: u64,
    /// Batch (training) or largest batch (inference).
    pub batch: u64,
    /// Longest sequence.
    pub max_seq: u64,
}

impl GenSpec {
    /// A GPT-2-small-like workload of `kind` (a few GiB at its peak).
    pub fn standard(kind: GenKind, seed: u64) -> Self {
        Self {
            kind,
            seed,
            steps: 12,
            layers: 12,
            hidden: 768,
            batch: 8,
            max_seq: 1024,
        }
    }
    /// A tiny workload (a few MiB), for tests.
    pub fn tiny(kind: GenKind, seed: u64) -> Self {
        Self {
            kind,
            seed,
            steps: 4,
            layers: 2,
            hidden: 64,
            batch: 2,
            max_seq: 128,
        }
    }
}

/// SplitMix64: small, fast, and the same everywhere.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

struct Builder {
    events: Vec<Event>,
    next: u64,
    live: HashMap<u64, u64>,
}

impl Builder {
    fn alloc(&mut self, bytes: u64) -> u64 {
        let id = self.next;
        self.next += 1;
        self.live.insert(id, bytes);
        self.events.push(Event::alloc(id, bytes.max(1), 0));
        id
    }
    fn free(&mut self, id: u64) {
        if let Some(b) = self.live.remove(&id) {
            self.events.push(Event::free(id, b.max(1), 0));
        }
    }
    fn free_all(&mut self, ids: &mut Vec<u64>) {
        for id in ids.drain(..).rev() {
            self.free(id);
        }
    }
}

/// Generates the trace `spec` describes.
///
/// ```
/// use oomguard_cli::gen::{generate, GenKind, GenSpec};
/// let a = generate(&GenSpec::tiny(GenKind::Training, 7));
/// assert_eq!(a, generate(&GenSpec::tiny(GenKind::Training, 7)));
/// assert_ne!(a, generate(&GenSpec::tiny(GenKind::Training, 8)));
/// ```
pub fn generate(spec: &GenSpec) -> Trace {
    let mut b = Builder {
        events: Vec::new(),
        next: 0,
        live: HashMap::new(),
    };
    let mut rng = Rng(spec.seed ^ 0x6f6f_6d67_7561_7264);
    match spec.kind {
        GenKind::Training => training(spec, &mut rng, &mut b),
        GenKind::Inference => inference(spec, &mut rng, &mut b),
    }
    Trace::new(TraceFormat::Csv, b.events)
}

const F32: u64 = 4;
const BF16: u64 = 2;

fn param_sizes(spec: &GenSpec) -> Vec<u64> {
    let h = spec.hidden;
    let mut v = vec![32_000 * h * F32]; // embedding
    for _ in 0..spec.layers {
        v.extend([
            3 * h * h * F32,
            3 * h * F32,
            h * h * F32,
            h * F32,
            4 * h * h * F32,
            4 * h * F32,
            4 * h * h * F32,
            h * F32,
            h * F32,
            h * F32,
        ]);
    }
    v
}

fn training(spec: &GenSpec, rng: &mut Rng, b: &mut Builder) {
    let h = spec.hidden;
    let heads = (h / 64).max(1);
    let params = param_sizes(spec);
    for &p in &params {
        b.alloc(p);
    }
    let mut optim_state_made = false;
    for _ in 0..spec.steps {
        let min_seq = (spec.max_seq / 4).max(8);
        let seq = rng.range(min_seq, spec.max_seq).next_multiple_of(8);
        let tokens = spec.batch * seq;
        let input = b.alloc(tokens * 8);
        let mut saved: Vec<Vec<u64>> = Vec::new();
        let mut x = b.alloc(tokens * h * BF16);
        for _ in 0..spec.layers {
            let mut keep = vec![x];
            let ln = b.alloc(tokens * h * BF16);
            keep.push(ln);
            let qkv = b.alloc(tokens * 3 * h * BF16);
            keep.push(qkv);
            let scores = b.alloc(spec.batch * heads * seq * seq * BF16);
            let probs = b.alloc(spec.batch * heads * seq * seq * BF16);
            b.free(scores);
            keep.push(probs);
            let attn = b.alloc(tokens * h * BF16);
            keep.push(attn);
            let fc1 = b.alloc(tokens * 4 * h * BF16);
            keep.push(fc1);
            let act = b.alloc(tokens * 4 * h * BF16);
            keep.push(act);
            x = b.alloc(tokens * h * BF16);
            saved.push(keep);
        }
        let logits = b.alloc(tokens * 32_000 * F32);
        let loss = b.alloc(4);
        let mut grad = b.alloc(tokens * 32_000 * F32);
        b.free(logits);
        let mut grads: Vec<u64> = Vec::new();
        let g_emb = b.alloc(params[0]);
        grads.push(g_emb);
        let gx = b.alloc(tokens * h * BF16);
        b.free(grad);
        grad = gx;
        b.free(x);
        for (l, mut keep) in saved.into_iter().enumerate().rev() {
            for k in 0..10 {
                grads.push(b.alloc(params[1 + l * 10 + k]));
            }
            let tmp = b.alloc(tokens * 4 * h * BF16);
            let tmp2 = b.alloc(spec.batch * heads * seq * seq * BF16);
            b.free(tmp2);
            b.free(tmp);
            let gx = b.alloc(tokens * h * BF16);
            b.free(grad);
            grad = gx;
            b.free_all(&mut keep);
        }
        b.free(grad);
        b.free(loss);
        b.free(input);
        if !optim_state_made {
            for &p in &params {
                b.alloc(p);
                b.alloc(p);
            }
            optim_state_made = true;
        }
        for &p in params.iter().take(8) {
            let t = b.alloc(p);
            b.free(t);
        }
        b.free_all(&mut grads); // zero_grad(set_to_none=True)
    }
}

fn inference(spec: &GenSpec, rng: &mut Rng, b: &mut Builder) {
    let h = spec.hidden;
    let params = param_sizes(spec);
    for &p in &params {
        b.alloc(p);
    }
    // Up to three requests in flight; each owns per-layer K/V caches that grow as it decodes.
    struct Req {
        batch: u64,
        len: u64,
        left: u64,
        kv: Vec<u64>,
    }
    let mut active: Vec<Req> = Vec::new();
    let mut started = 0u32;
    while started < spec.steps || !active.is_empty() {
        if started < spec.steps && (active.len() < 3) && rng.range(0, 2) > 0 {
            started += 1;
            let batch = rng.range(1, spec.batch.max(1));
            let len = rng.range(8, (spec.max_seq / 2).max(8));
            let left = rng.range(4, (spec.max_seq / 2).max(4));
            let tokens = batch * len;
            let x = b.alloc(tokens * h * BF16);
            let mut kv = Vec::new();
            for _ in 0..spec.layers {
                kv.push(b.alloc(2 * tokens * h * BF16));
                let t = b.alloc(tokens * 4 * h * BF16);
                b.free(t);
            }
            b.free(x);
            active.push(Req {
                batch,
                len,
                left,
                kv,
            });
        }
        // One decode step for every active request; caches grow every 16 tokens by reallocation.
        for r in active.iter_mut() {
            let x = b.alloc(r.batch * h * BF16);
            r.len += 1;
            r.left -= 1;
            if r.len % 16 == 0 {
                for slot in r.kv.iter_mut() {
                    let bigger = b.alloc(2 * r.batch * (r.len + 16) * h * BF16);
                    b.free(*slot);
                    *slot = bigger;
                }
            }
            let logits = b.alloc(r.batch * 32_000 * F32);
            b.free(logits);
            b.free(x);
        }
        active.retain_mut(|r| {
            if r.left == 0 {
                b.free_all(&mut r.kv);
                false
            } else {
                true
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Op;

    #[test]
    fn traces_are_valid_and_vary() {
        for kind in [GenKind::Training, GenKind::Inference] {
            let t = generate(&GenSpec::tiny(kind, 1));
            let mut live = std::collections::HashSet::new();
            for e in &t.events {
                match e.op {
                    Op::Alloc => assert!(live.insert(e.id), "duplicate id {}", e.id),
                    Op::Free => assert!(live.remove(&e.id), "free of dead id {}", e.id),
                }
            }
            assert!(t.events.len() > 50, "{kind:?}: {}", t.events.len());
            // Round trip through the CSV format.
            let back =
                crate::csv_trace::parse(crate::csv_trace::write(&t.events).as_bytes()).unwrap();
            assert_eq!(back.events, t.events);
            // Shapes vary with the seed.
            let sizes = |t: &Trace| {
                let mut s: Vec<u64> = t.events.iter().map(|e| e.bytes).collect();
                s.sort_unstable();
                s.dedup();
                s
            };
            assert_ne!(sizes(&t), sizes(&generate(&GenSpec::tiny(kind, 2))));
        }
    }
}
