//! Where a replay calls the allocator from: the replaying thread, or one worker thread per thread
//! of the recording process (`replay --threads`).
//!
//! With workers, the replay still makes one call at a time in trace order: the call of event k
//! goes to the worker of event k's thread, and the replay waits for its answer before event
//! k + 1. Only the calling threads differ, so the allocator sees the threads the program had
//! (its thread caches once a second thread allocates) and nothing else changes. Workers live for
//! the whole replay: a thread that exits hands its cache back, which the recorded threads did not.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use oomguard_runtime::backend::StreamId;
use oomguard_runtime::{Allocation, CachingAllocator, Error};

/// The most threads a replay with `--threads` starts (each a thread of this process): far more
/// than a training process has, few enough that a trace naming millions cannot exhaust the host.
pub const MAX_THREADS: usize = 1024;

/// A worker's stack: Rust's default for a new thread, set here so that the room checked before
/// a start is the room the start takes.
const WORKER_STACK: usize = 2 << 20;

/// Address space a worker's start takes beside its stack (the signal stack Rust maps for it,
/// glibc's record of its destructors), with room to spare.
const WORKER_START: usize = 1 << 20;

/// The number of distinct threads the events of `events` name.
///
/// ```
/// use oomguard_cli::{threads::thread_count, Event};
/// let e = [Event::alloc(0, 1, 0).on_thread(4), Event::free(0, 1, 0).on_thread(9), Event::alloc(1, 1, 0).on_thread(4)];
/// assert_eq!(thread_count(&e), 2);
/// assert_eq!(thread_count(&[]), 0);
/// ```
pub fn thread_count(events: &[crate::Event]) -> usize {
    let mut seen = std::collections::HashSet::new();
    events.iter().filter(|e| seen.insert(e.thread)).count()
}

/// An allocator call.
enum Call {
    Alloc(u64, StreamId),
    Free(Allocation),
}

/// Its answer.
enum Answer {
    Alloc(Result<Allocation, Error>),
    Free(Result<(), Error>),
}

/// Why a call failed: the allocator's error, or the replay's own (a worker that could not start
/// or stopped answering).
#[derive(Debug)]
pub(crate) struct CallError {
    /// An out-of-memory error of the allocator.
    pub oom: bool,
    /// The replay's own failure (a worker that could not start or stopped answering), not the
    /// allocator's: the replay stops, since what follows would not be the trace's.
    pub replay: bool,
    /// What failed.
    pub message: String,
}

impl From<Error> for CallError {
    fn from(e: Error) -> Self {
        Self {
            oom: e.is_oom(),
            replay: false,
            message: e.to_string(),
        }
    }
}

fn replay_error(message: String) -> CallError {
    CallError {
        oom: false,
        replay: true,
        message,
    }
}

struct Worker {
    calls: Sender<Call>,
    /// Its own channel back: a worker that panicked closes it, and the replay sees that rather
    /// than waiting for ever.
    answers: Receiver<Answer>,
    handle: JoinHandle<()>,
    /// Whether it was handed memory (the allocator's multi-thread mode starts when a second
    /// thread allocates; a request of 0 bytes, or one refused before the allocator looks at
    /// its pools, does not count).
    allocated: bool,
}

/// Calls the allocator on the replaying thread, or on the worker of each recorded thread.
pub(crate) struct Callers {
    alloc: Arc<CachingAllocator>,
    /// `None`: every call on the replaying thread.
    workers: Option<HashMap<u64, Worker>>,
    /// Whether the replaying thread called the allocator, and allocated.
    here: (bool, bool),
}

impl Callers {
    /// Calls on `alloc`, from worker threads when `threads` is set.
    pub fn new(alloc: Arc<CachingAllocator>, threads: bool) -> Self {
        if threads {
            crate::host_memory::one_heap_for_all_threads();
        }
        Self {
            alloc,
            workers: threads.then(HashMap::new),
            here: (false, false),
        }
    }

    /// Allocates `bytes` on `stream` on behalf of recorded thread `thread`.
    pub fn allocate(
        &mut self,
        thread: u64,
        bytes: u64,
        stream: StreamId,
    ) -> Result<Allocation, CallError> {
        match self.call(thread, Call::Alloc(bytes, stream))? {
            Answer::Alloc(r) => Ok(r?),
            Answer::Free(_) => Err(replay_error("a free's answer to an allocation".into())),
        }
    }

    /// Frees `a` on behalf of recorded thread `thread`.
    pub fn free(&mut self, thread: u64, a: Allocation) -> Result<(), CallError> {
        match self.call(thread, Call::Free(a))? {
            Answer::Free(r) => Ok(r?),
            Answer::Alloc(_) => Err(replay_error("an allocation's answer to a free".into())),
        }
    }

    /// Threads that called the allocator, and those of them that were handed memory (an
    /// allocation of more than 0 bytes that succeeded).
    pub fn threads(&self) -> (usize, usize) {
        match &self.workers {
            None => (usize::from(self.here.0), usize::from(self.here.1)),
            Some(w) => (w.len(), w.values().filter(|w| w.allocated).count()),
        }
    }

    fn call(&mut self, thread: u64, call: Call) -> Result<Answer, CallError> {
        let Some(workers) = &mut self.workers else {
            self.here.0 = true;
            let answer = match call {
                Call::Alloc(bytes, stream) => Answer::Alloc(self.alloc.allocate(bytes, stream)),
                Call::Free(a) => Answer::Free(self.alloc.free(a)),
            };
            self.here.1 |= handed_memory(&answer);
            return Ok(answer);
        };
        let worker = match workers.entry(thread) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let (calls, calls_rx) = channel::<Call>();
                let (answers_tx, answers) = channel::<Answer>();
                let alloc = Arc::clone(&self.alloc);
                let cannot_start = |why: String| {
                    replay_error(format!(
                        "could not start a thread for recorded thread {thread}: {why}"
                    ))
                };
                if !crate::host_memory::address_space_for(WORKER_STACK + WORKER_START) {
                    return Err(cannot_start(format!(
                        "the machine (or a limit such as `ulimit -v`) leaves less than {} MiB \
                         of address space for its stack",
                        (WORKER_STACK + WORKER_START) >> 20
                    )));
                }
                let handle = std::thread::Builder::new()
                    .name(format!("replay-thread-{thread}"))
                    .stack_size(WORKER_STACK)
                    .spawn(move || serve(&alloc, &calls_rx, &answers_tx))
                    .map_err(|e| cannot_start(e.to_string()))?;
                v.insert(Worker {
                    calls,
                    answers,
                    handle,
                    allocated: false,
                })
            }
        };
        let lost = || {
            replay_error(format!(
                "the replay's thread for recorded thread {thread} stopped answering"
            ))
        };
        worker.calls.send(call).map_err(|_| lost())?;
        let answer = worker.answers.recv().map_err(|_| lost())?;
        worker.allocated |= handed_memory(&answer);
        Ok(answer)
    }
}

impl Drop for Callers {
    fn drop(&mut self) {
        if let Some(workers) = self.workers.take() {
            // closing its channel ends a worker's loop: close them all, then wait
            let handles: Vec<JoinHandle<()>> = workers.into_values().map(|w| w.handle).collect();
            for h in handles {
                let _ = h.join();
            }
        }
    }
}

fn handed_memory(answer: &Answer) -> bool {
    matches!(answer, Answer::Alloc(Ok(a)) if a.size > 0)
}

/// A worker's loop: each call, answered, until the replay closes the channel.
fn serve(alloc: &CachingAllocator, calls: &Receiver<Call>, answers: &Sender<Answer>) {
    for call in calls {
        let answer = match call {
            Call::Alloc(bytes, stream) => Answer::Alloc(alloc.allocate(bytes, stream)),
            Call::Free(a) => Answer::Free(alloc.free(a)),
        };
        if answers.send(answer).is_err() {
            return;
        }
    }
}
