//! How the allocator lends blocks to thread caches and takes them back (multi-thread mode; the
//! caches themselves are in `thread_cache`).

use std::panic::Location;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use parking_lot::MutexGuard;

use super::block::{BlockId, BlockState, PoolKind};
use super::state::State;
use super::thread_cache::{self, CacheState, Slot, SlotState, ThreadCache};
use super::{Allocation, CachingAllocator, BORROWED};
use crate::backend::StreamId;
use crate::error::Error;

impl CachingAllocator {
    /// A thread other than the first allocates: switch to thread caches (once).
    #[cold]
    pub(super) fn thread_joined(&self, st: &mut State) {
        let token = thread_cache::thread_token();
        if st.owner_thread == 0 {
            st.owner_thread = token;
            return;
        }
        // the pass-through baseline never switches: no sub-allocation, no caching, on any
        // number of threads
        if st.multi || token == 0 || st.cfg.pass_through {
            return;
        }
        st.multi = true;
        let allocated = st.stats.allocated_bytes.all;
        st.live.start(allocated.current, allocated.peak);
        st.flush_parked();
        self.update_caching(st);
    }

    /// Whether the caches serve requests, from the state; cached blocks go back when they stop.
    pub(super) fn update_caching(&self, st: &mut State) {
        let on = st.multi && !st.cfg.pass_through && st.history.is_none() && st.scopes.is_empty();
        self.caching.store(on, Relaxed);
        if !on {
            self.drain_all_caches(st);
        }
    }

    /// The allocation slow path in multi-thread mode: the shared state finds a block and lends
    /// it, allocated, to the calling thread's cache.
    #[track_caller]
    pub(super) fn allocate_shared(
        &self,
        mut st: MutexGuard<'_, State>,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        bytes: u64,
    ) -> Result<Allocation, Error> {
        // before the shared state changes anything: keeps peaks exact for one thread (`peaks`)
        self.sync_own_cache(&mut st);
        if !pool.is_small() && self.parked_large.load(Relaxed) > 0 {
            // Large blocks parked by any thread are merged before a large block is placed: best
            // fit then sees the free space it would see without them.
            self.return_parked_large(&mut st);
        }
        if !st.pending.is_empty() {
            self.process_events(&mut st, false);
        }
        if self.orphans.load(Relaxed) > 0 {
            self.collect_orphans(&mut st);
        }
        // Unlike the quick lists of single-thread mode, the caches are not flushed on a miss:
        // that would empty them on every change of size and send the thread back here. They
        // go back before anything fails (`allocate_slow`).
        let planned = if st.steps.on {
            st.plan_take(pool, stream, size, self.total)
        } else {
            None
        };
        let id = match planned.or_else(|| st.take_free(pool, stream, size, self.total)) {
            Some(id) => id,
            None => match self.reclaim_under_pressure(&mut st, pool, stream, size) {
                Some(id) => id,
                None => self.allocate_slow(&mut st, pool, stream, size, bytes)?,
            },
        };
        if st.steps.on {
            st.step_allocated(id, pool, size, stream);
        }
        if self.caching.load(Relaxed) {
            if let Some(a) = self.lend(&mut st, id, bytes) {
                return Ok(a);
            }
        }
        st.mark_allocated(id, bytes);
        if st.history.is_some() {
            self.record_alloc(&mut st, id, stream);
        }
        Ok(self.handle(&st, id, bytes, stream))
    }

    /// A miss under pressure (growing would pass the memory limit or where the device refused
    /// memory): the blocks every thread's cache holds go back to the shared state, merged, and
    /// the request is looked up again before any page moves, as one-thread mode flushes its
    /// quick lists on every miss. Blocks held in caches are out of reach of merging and of
    /// moving pages: without this, a loop whose frees come from another thread (libtorch's
    /// autograd engine) ran out of memory once a step, inside the allocator, where the same
    /// loop on one thread only moved pages.
    fn reclaim_under_pressure(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Option<BlockId> {
        if !st.under_pressure(size, self.total) {
            return None;
        }
        self.drain_all_caches(st);
        st.take_free(pool, stream, size, self.total)
    }

    /// Lends taken block `id` to the calling thread's cache, allocated for `bytes` (`None`: the
    /// thread is exiting and has no cache).
    fn lend(&self, st: &mut State, id: BlockId, bytes: u64) -> Option<Allocation> {
        let b = &st.blocks[id];
        let slot = Slot {
            block: id,
            addr: b.addr,
            size: b.size,
            stream: b.stream,
            small: b.pool.is_small(),
            split: st.inactive_split(b),
            oversize: b.size >= st.cfg.max_split_size,
            state: SlotState::Vacant,
            generation: 0,
            requested: 0,
            other_streams: Vec::new(),
        };
        let a = self.with_own_cache(|c| {
            let mut cs = c.state.lock();
            // the shared changes of this allocation end here: a new window (`peaks`)
            st.sync_cache(c.index, &mut cs, true);
            let i = cs.insert(slot);
            cs.allocate(i, bytes, &self.generations);
            self.cached_handle(c.index, i, &cs.slots[i as usize])
        })?;
        let b = &mut st.blocks[id];
        b.state = BlockState::Lent;
        b.lent_to = (a.cache - 1, a.block);
        Some(a)
    }

    /// Runs `f` on the calling thread's cache, made when it has none (`None`: the thread is
    /// exiting).
    fn with_own_cache<R>(&self, f: impl FnOnce(&ThreadCache) -> R) -> Option<R> {
        let mut f = Some(f);
        if let Some(Some(r)) = thread_cache::with_thread_cache(self.id, |c| f.take().map(|f| f(c)))
        {
            return Some(r);
        }
        let cache = {
            let mut table = self.caches.write();
            let index = table
                .iter()
                .position(Option::is_none)
                .unwrap_or(table.len());
            let c = Arc::new(ThreadCache::new(
                index as u32,
                self.orphans.clone(),
                self.live.clone(),
                self.parked_large.clone(),
            ));
            if !thread_cache::set_thread_cache(self.id, c.clone()) {
                return None;
            }
            if index == table.len() {
                table.push(Some(c.clone()));
            } else {
                table[index] = Some(c.clone());
            }
            c
        };
        f.take().map(|f| f(&cache))
    }

    /// The cache of a handle (`cache` as handles carry it: index plus one).
    pub(super) fn cache_at(&self, cache: u32) -> Option<Arc<ThreadCache>> {
        let i = cache.checked_sub(1)? as usize;
        self.caches.read().get(i).cloned().flatten()
    }

    /// Every cache, in table order.
    pub(super) fn cache_list(&self) -> Vec<Arc<ThreadCache>> {
        self.caches.read().iter().flatten().cloned().collect()
    }

    /// Frees an allocation handed out by a cache: parked in that cache when it can be, else
    /// given back to the shared state.
    #[track_caller]
    pub(super) fn free_cached(&self, a: Allocation) -> Result<(), Error> {
        if a.owner == self.id && !a.is_borrowed() {
            // (a large block parks only in the cache of the thread that frees it, while no step
            // is marked: a step plan records every large request at the shared state)
            let park = |c: &ThreadCache, own: bool| {
                let mut cs = c.state.lock();
                // checked under the cache's lock: caching stops before the caches are drained
                self.caching.load(Relaxed)
                    && cs.is_live(a.block, a.generation, a.ptr)
                    && cs.park(a.block, own && self.park_large.load(Relaxed))
            };
            let own = thread_cache::with_thread_cache(self.id, |c| {
                (c.index + 1 == a.cache).then(|| park(c, true))
            })
            .flatten();
            let parked = match own {
                Some(p) => p,
                None => self.cache_at(a.cache).is_some_and(|c| park(&c, false)),
            };
            if parked {
                return Ok(());
            }
        }
        self.free_cached_slow(a, Location::caller())
    }

    /// A cache's allocation freed through the shared state (validated under both locks).
    #[cold]
    fn free_cached_slow(
        &self,
        a: Allocation,
        loc: &'static Location<'static>,
    ) -> Result<(), Error> {
        let mut st = self.lock();
        let cache = if a.owner == self.id {
            self.cache_at(a.cache)
        } else {
            None
        };
        let Some(cache) = cache else {
            return self.reject_free(&mut st, &a);
        };
        let mut cs = cache.state.lock();
        if a.is_borrowed() || !cs.is_live(a.block, a.generation, a.ptr) {
            drop(cs);
            return self.reject_free(&mut st, &a);
        }
        // the shared state's changes get a window of their own, before and after (`peaks`)
        let own = self.own_cache_index() == Some(cache.index);
        st.sync_cache(cache.index, &mut cs, own);
        let id = unlend(&mut st, &mut cs, a.block);
        let gone = cs.owner_gone && cs.collected && cs.live == 0 && cs.cached == 0;
        drop(cs);
        if gone {
            self.remove_cache(&mut st, cache.index);
        }
        self.free_block(&mut st, &a, id, loc);
        if !gone {
            st.sync_cache(cache.index, &mut cache.state.lock(), own);
        }
        Ok(())
    }

    /// `record_stream` on a cache's allocation.
    pub(super) fn record_stream_cached(
        &self,
        a: &Allocation,
        stream: StreamId,
    ) -> Result<(), Error> {
        let generation = a.generation & !BORROWED;
        let cache = if a.owner == self.id {
            self.cache_at(a.cache)
        } else {
            None
        };
        let recorded = cache.is_some_and(|c| {
            let mut cs = c.state.lock();
            if !cs.is_live(a.block, generation, a.ptr) {
                return false;
            }
            let s = &mut cs.slots[a.block as usize];
            if stream != s.stream && !s.other_streams.contains(&stream) {
                s.other_streams.push(stream);
            }
            true
        });
        if recorded {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "record_stream on {:#x}: not a live allocation of this allocator",
                a.ptr
            )))
        }
    }

    /// Returns the calling thread's cached blocks to the shared state.
    pub(super) fn drain_own_cache(&self) {
        let mut st = self.lock();
        thread_cache::with_thread_cache(self.id, |c| {
            drain(&mut st, c.index, &mut c.state.lock(), true)
        });
    }

    /// Returns every thread's cached blocks to the shared state (under pressure, on
    /// `empty_cache`, when caching stops).
    pub(super) fn drain_all_caches(&self, st: &mut State) {
        let own = self.own_cache_index();
        for c in self.cache_list() {
            drain(st, c.index, &mut c.state.lock(), own == Some(c.index));
        }
    }

    /// Collects the caches of exited threads: their cached blocks go back; a cache with no
    /// allocation left leaves the table.
    fn collect_orphans(&self, st: &mut State) {
        for c in self.cache_list() {
            let mut cs = c.state.lock();
            if cs.owner_gone && !cs.collected {
                drain(st, c.index, &mut cs, false);
                cs.collected = true;
                self.orphans.fetch_sub(1, Relaxed);
                if cs.live == 0 {
                    drop(cs);
                    self.remove_cache(st, c.index);
                }
            }
        }
    }

    /// Takes a cache out of the table, its statistics folded first (none of them is lost).
    fn remove_cache(&self, st: &mut State, index: u32) {
        self.fold_caches(st);
        if let Some(e) = self.caches.write().get_mut(index as usize) {
            if let Some(c) = e.take() {
                c.state.lock().uncount_large();
            }
        }
    }

    /// Runs `f` with every cache locked, each with its index (the caller holds the allocator's
    /// lock: the lock order).
    pub(super) fn with_caches_locked<R>(
        &self,
        f: impl FnOnce(&mut [(u32, &mut CacheState)]) -> R,
    ) -> R {
        let caches = self.cache_list();
        let mut guards: Vec<_> = caches.iter().map(|c| c.state.lock()).collect();
        let mut locked: Vec<(u32, &mut CacheState)> = caches
            .iter()
            .zip(guards.iter_mut())
            .map(|(c, g)| (c.index, &mut **g))
            .collect();
        f(&mut locked)
    }

    /// Moves the calling thread's cache's statistics into the shared ones.
    fn sync_own_cache(&self, st: &mut State) {
        thread_cache::with_thread_cache(self.id, |c| {
            st.sync_cache(c.index, &mut c.state.lock(), true)
        });
    }

    /// Returns every cache's parked large block to the shared state, merged and indexed.
    fn return_parked_large(&self, st: &mut State) {
        let own = self.own_cache_index();
        for c in self.cache_list() {
            let mut cs = c.state.lock();
            if !cs.large_counted() {
                continue;
            }
            let is_own = own == Some(c.index);
            st.sync_cache(c.index, &mut cs, is_own);
            if let Some(i) = cs.take_large() {
                let slot = cs.vacate(i);
                st.unpark(slot.block);
            }
            st.sync_cache(c.index, &mut cs, is_own);
        }
    }

    /// The index of the calling thread's cache, if it has one.
    fn own_cache_index(&self) -> Option<u32> {
        thread_cache::with_thread_cache(self.id, |c| c.index)
    }

    /// Folds every cache's statistics into the shared ones (multi-thread mode).
    pub(super) fn fold_caches(&self, st: &mut State) {
        if !st.multi {
            return;
        }
        self.with_caches_locked(|caches| st.peaks.fold(&mut st.stats, caches));
    }
}

/// Takes allocated slot `i` out of its cache: its block continues as an allocation of the
/// shared state (the cache was synced first: its counts are in the shared statistics).
fn unlend(st: &mut State, cs: &mut CacheState, i: u32) -> BlockId {
    let slot = cs.vacate(i);
    cs.live -= 1;
    let b = &mut st.blocks[slot.block];
    b.state = BlockState::Allocated;
    b.requested = slot.requested;
    b.generation = slot.generation;
    b.other_streams = slot.other_streams;
    slot.block
}

/// Returns cache `index`'s cached blocks to the shared state, merged and indexed (the cache
/// synced first: their counts are in the shared statistics; `own`: the caller's cache).
fn drain(st: &mut State, index: u32, cs: &mut CacheState, own: bool) {
    if cs.cached == 0 {
        return;
    }
    st.sync_cache(index, cs, own);
    for i in cs.drain_cached() {
        let slot = cs.vacate(i);
        st.unpark(slot.block);
    }
    st.sync_cache(index, cs, own);
}
