//! One device's driver-pool state, shared by every `DriverPool` handle of the device: which pool
//! oomguard made current, the caps of the live budget guards, and the spare pools. The
//! logic lives here, over the [`PoolDriver`] trait, so it is tested without a GPU (a fake
//! driver below records every call and flags any use of a destroyed pool, and any destruction
//! of a pool that has been current).
//!
//! Rules (so that nested and overlapping budgets each cap what they promise, and none outlives
//! its guard):
//! - every live budget has its own capped pool; the pool *in force* (current on the device) is
//!   the one of the live budget with the smallest limit (the newest among equals), or, with no
//!   budget live, the *base* pool: the pool that was current when the first budget was made, or
//!   the pool a builder installed since;
//! - a pool that has been current is never destroyed: another thread's `cuMemAllocAsync` picks
//!   the device's current pool inside the driver, outside any lock of ours, and may still be
//!   allocating from it after it was switched away; the driver does not promise that destroying
//!   such a pool is safe (on the H100, two threads making and dropping budgets while allocating
//!   crashed the test process while such pools were destroyed). A budget's
//!   pool that no budget refers to and that is not current is trimmed (its unused memory goes
//!   back to the device) and kept as a *spare*; a later budget with the same limit reuses it. So
//!   a process holds one driver pool per distinct budget limit it used (host-side bookkeeping;
//!   no device memory once trimmed). The only pool destroyed is a new one that could not be made
//!   current (nothing can have allocated from it);
//! - a failed switch leaves the state saying what is really current (its cap included); the
//!   pool that could not be replaced becomes a spare at the first later switch that works.

use std::fmt;

use super::zero_budget;
use crate::error::Result;

/// The driver calls the state needs, for one device.
pub(crate) trait PoolDriver {
    /// A pool handle.
    type Pool: Copy + Eq + fmt::Debug;
    /// The device's current pool (`cuDeviceGetMemPool`).
    fn current(&self) -> Result<Self::Pool>;
    /// Makes `pool` the device's current pool (`cuDeviceSetMemPool`).
    fn set_current(&self, pool: Self::Pool) -> Result<()>;
    /// A new pool (`cuMemPoolCreate`, then the release threshold).
    fn create(&self, max_size: Option<u64>, release_threshold: Option<u64>) -> Result<Self::Pool>;
    /// Returns the pool's unused memory (`cuMemPoolTrimTo(pool, 0)`).
    fn trim(&self, pool: Self::Pool);
    /// Waits for the device's queued work (pending frees).
    fn synchronize(&self);
    /// Destroys the pool (`cuMemPoolDestroy`; the driver frees it once its last allocation is).
    fn destroy(&self, pool: Self::Pool) -> Result<()>;
}

/// A live budget.
#[derive(Clone, Copy, Debug)]
struct Live<P> {
    id: u64,
    limit: u64,
    pool: P,
}

/// The state of one device's pools.
#[derive(Debug)]
pub(crate) struct PoolState<P> {
    /// The pool current when no budget is live (`None`: not known yet, whatever the device has)
    /// and the cap oomguard installed it with.
    base: Option<(P, Option<u64>)>,
    /// Pools made by [`PoolState::install`], with their caps (to know a base's cap again).
    installed: Vec<(P, Option<u64>)>,
    /// Live budgets, in creation order.
    budgets: Vec<Live<P>>,
    /// What oomguard made current, and its cap (`None` until oomguard installs a pool).
    current: Option<(P, Option<u64>)>,
    /// Budget pools no guard refers to that were still current when their guard dropped:
    /// trimmed and made spare once they are not.
    retired: Vec<(u64, P)>,
    /// Budget pools no guard refers to and not current, trimmed, by limit: reused by a budget
    /// of the same limit, never destroyed.
    spare: Vec<(u64, P)>,
    next_id: u64,
}

impl<P: Copy + Eq + fmt::Debug> Default for PoolState<P> {
    fn default() -> Self {
        Self {
            base: None,
            installed: Vec::new(),
            budgets: Vec::new(),
            current: None,
            retired: Vec::new(),
            spare: Vec::new(),
            next_id: 1,
        }
    }
}

impl<P: Copy + Eq + fmt::Debug> PoolState<P> {
    /// The cap of the pool in force, as oomguard installed it (`None`: no cap known).
    pub(crate) fn cap(&self) -> Option<u64> {
        self.current.and_then(|(_, cap)| cap)
    }

    /// The spare pools (trimmed, kept for reuse).
    #[cfg(test)]
    pub(crate) fn spare_pools(&self) -> Vec<P> {
        self.spare.iter().map(|s| s.1).collect()
    }

    /// Number of live budgets.
    #[cfg(test)]
    pub(crate) fn live_budgets(&self) -> usize {
        self.budgets.len()
    }

    /// The pool that should be current, with its cap.
    fn wanted(&self) -> Option<(P, Option<u64>)> {
        let tightest = self
            .budgets
            .iter()
            .rev()
            .min_by_key(|b| b.limit)
            .map(|b| (b.pool, Some(b.limit)));
        tightest.or(self.base)
    }

    /// Makes the wanted pool current if it is not, then trims the retired pools that are not
    /// current and keeps them as spares. A failed switch is returned; the state then still says
    /// what is current.
    fn settle<D: PoolDriver<Pool = P>>(&mut self, driver: &D) -> Result<()> {
        let switched = match self.wanted() {
            Some(want) if self.current.map(|c| c.0) != Some(want.0) => {
                let before = self.current;
                driver.set_current(want.0).map(|()| {
                    self.current = Some(want);
                    // What the pool switched from cached cannot serve the new one.
                    if let Some((old, _)) = before {
                        if !self.retired.iter().any(|r| r.1 == old) {
                            driver.trim(old);
                        }
                    }
                })
            }
            _ => Ok(()),
        };
        let current = self.current.map(|c| c.0);
        if self.retired.iter().any(|p| Some(p.1) != current) {
            // Pending frees complete first, so the trim returns their memory too.
            driver.synchronize();
            let (gone, kept): (Vec<_>, Vec<_>) =
                self.retired.iter().partition(|p| Some(p.1) != current);
            self.retired = kept;
            for (limit, p) in gone {
                driver.trim(p);
                self.spare.push((limit, p));
            }
        }
        switched
    }

    /// Retries a switch that failed earlier (cheap when there is none).
    pub(crate) fn repair<D: PoolDriver<Pool = P>>(&mut self, driver: &D) {
        if self.retired.is_empty()
            && self
                .wanted()
                .is_none_or(|w| Some(w.0) == self.current.map(|c| c.0))
        {
            return;
        }
        if let Err(e) = self.settle(driver) {
            tracing::warn!(target: "oomguard::source", error = %e, "restoring the device's memory pool failed again");
        }
    }

    /// A budget of `limit` bytes: a new pool capped at `limit`, current while it is the
    /// tightest live budget. Returns its id for [`PoolState::release`].
    pub(crate) fn budget<D: PoolDriver<Pool = P>>(
        &mut self,
        driver: &D,
        limit: u64,
    ) -> Result<u64> {
        if limit == 0 {
            return Err(zero_budget());
        }
        if self.budgets.is_empty() {
            // The base is what is current now (someone other than oomguard may have changed it),
            // unless that is a budget's pool a failed restore left current.
            self.repair(driver);
            let now = driver.current()?;
            if !self.retired.iter().any(|r| r.1 == now) {
                let cap = self
                    .installed
                    .iter()
                    .find(|(p, _)| *p == now)
                    .and_then(|(_, cap)| *cap);
                self.base = Some((now, cap));
                if self.current.map(|c| c.0) != Some(now) {
                    self.current = Some((now, cap));
                }
            }
        }
        let reused = self.spare.iter().position(|(l, _)| *l == limit);
        let pool = match reused {
            Some(i) => self.spare.remove(i).1,
            None => driver.create(Some(limit), Some(u64::MAX))?,
        };
        let id = self.next_id;
        self.next_id += 1;
        self.budgets.push(Live { id, limit, pool });
        if let Err(e) = self.settle(driver) {
            self.budgets.retain(|b| b.id != id);
            if reused.is_some() {
                self.spare.push((limit, pool));
            } else if let Err(d) = driver.destroy(pool) {
                // A new pool never made current: nothing can have allocated from it.
                tracing::warn!(target: "oomguard::source", error = %d, "destroying a capped memory pool failed");
            }
            return Err(e);
        }
        Ok(id)
    }

    /// Drops the budget `id`: the next tightest live budget's pool, or the base, is current
    /// again if this one was in force; its pool is trimmed and kept as a spare once it is not
    /// current.
    pub(crate) fn release<D: PoolDriver<Pool = P>>(&mut self, driver: &D, id: u64) {
        let Some(i) = self.budgets.iter().position(|b| b.id == id) else {
            return;
        };
        let gone = self.budgets.remove(i);
        self.retired.push((gone.limit, gone.pool));
        if let Err(e) = self.settle(driver) {
            tracing::warn!(
                target: "oomguard::source",
                error = %e,
                "restoring the device's memory pool failed: the capped pool stays current (its cap in force) until a later switch works"
            );
        }
    }

    /// A pool made by a builder becomes the base: current now if no budget is live, else once
    /// the last live budget drops (a budget's cap stays in force while it lives).
    pub(crate) fn install<D: PoolDriver<Pool = P>>(
        &mut self,
        driver: &D,
        max_size: Option<u64>,
        release_threshold: Option<u64>,
    ) -> Result<()> {
        let pool = driver.create(max_size, release_threshold)?;
        let before = self.base;
        self.base = Some((pool, max_size));
        if let Err(e) = self.settle(driver) {
            self.base = before;
            if let Err(d) = driver.destroy(pool) {
                tracing::warn!(target: "oomguard::source", error = %d, "destroying a memory pool failed");
            }
            return Err(e);
        }
        self.installed.push((pool, max_size));
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A driver that records calls and flags misuse.
    use super::*;
    use crate::error::Error;
    use std::cell::RefCell;

    #[derive(Default)]
    pub(crate) struct Fake {
        pub calls: RefCell<Vec<String>>,
        /// Pools that exist (index = handle; false once destroyed).
        pub alive: RefCell<Vec<bool>>,
        pub current: RefCell<usize>,
        /// Misuse seen (a destroyed pool used, the current pool destroyed).
        pub violations: RefCell<Vec<String>>,
        pub fail_set_current: RefCell<u32>,
        pub fail_create: RefCell<bool>,
        /// Pools that have been current at some time.
        pub ever_current: RefCell<Vec<usize>>,
    }

    impl Fake {
        pub(crate) fn new() -> Self {
            let f = Self::default();
            f.alive.borrow_mut().push(true); // pool 0: the device's default pool
            f.ever_current.borrow_mut().push(0);
            f
        }
        fn check(&self, op: &str, p: usize) {
            if !self.alive.borrow().get(p).copied().unwrap_or(false) {
                self.violations
                    .borrow_mut()
                    .push(format!("{op} on destroyed pool {p}"));
            }
        }
        pub(crate) fn live_pools(&self) -> usize {
            self.alive.borrow().iter().filter(|a| **a).count()
        }
    }

    impl PoolDriver for Fake {
        type Pool = usize;
        fn current(&self) -> Result<usize> {
            Ok(*self.current.borrow())
        }
        fn set_current(&self, p: usize) -> Result<()> {
            self.check("set_current", p);
            let mut fail = self.fail_set_current.borrow_mut();
            if *fail > 0 {
                *fail -= 1;
                self.calls
                    .borrow_mut()
                    .push(format!("set_current {p} (failed)"));
                return Err(Error::InvalidArgument(
                    "injected cuDeviceSetMemPool failure".into(),
                ));
            }
            self.calls.borrow_mut().push(format!("set_current {p}"));
            *self.current.borrow_mut() = p;
            self.ever_current.borrow_mut().push(p);
            Ok(())
        }
        fn create(&self, max: Option<u64>, _t: Option<u64>) -> Result<usize> {
            if std::mem::take(&mut *self.fail_create.borrow_mut()) {
                return Err(Error::InvalidArgument(
                    "injected cuMemPoolCreate failure".into(),
                ));
            }
            let mut alive = self.alive.borrow_mut();
            alive.push(true);
            let p = alive.len() - 1;
            self.calls
                .borrow_mut()
                .push(format!("create {p} max {max:?}"));
            Ok(p)
        }
        fn trim(&self, p: usize) {
            self.calls.borrow_mut().push(format!("trim {p}"));
            self.check("trim", p);
        }
        fn synchronize(&self) {}
        fn destroy(&self, p: usize) -> Result<()> {
            self.calls.borrow_mut().push(format!("destroy {p}"));
            self.check("destroy", p);
            if p == *self.current.borrow() {
                self.violations
                    .borrow_mut()
                    .push(format!("destroy of the current pool {p}"));
            }
            if self.ever_current.borrow().contains(&p) {
                // another thread's cuMemAllocAsync may still be allocating from it
                self.violations
                    .borrow_mut()
                    .push(format!("destroy of pool {p}, which has been current"));
            }
            if let Some(a) = self.alive.borrow_mut().get_mut(p) {
                *a = false;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::Fake;
    use super::*;

    const MIB: u64 = 1 << 20;

    fn clean(f: &Fake) {
        assert!(
            f.violations.borrow().is_empty(),
            "{:?}\ncalls: {:?}",
            f.violations.borrow(),
            f.calls.borrow()
        );
    }

    /// With no budget live: every capped pool that still exists is a spare (none leaked), and
    /// each spare was trimmed after it was last current (its memory went back to the device).
    fn all_spare(f: &Fake, s: &PoolState<usize>) {
        let spare = s.spare_pools();
        assert_eq!(f.live_pools(), 1 + spare.len(), "{:?}", f.calls.borrow());
        let calls = f.calls.borrow();
        for p in spare {
            let last = calls
                .iter()
                .rev()
                .find(|c| c.ends_with(&format!(" {p}")))
                .cloned();
            assert_eq!(
                last,
                Some(format!("trim {p}")),
                "{:?}",
                &calls[calls.len().saturating_sub(20)..]
            );
        }
    }

    /// Every order of dropping three budgets (the old code reinstalled a destroyed pool when a
    /// guard dropped out of creation order): no destroyed pool is ever used, the cap in force
    /// is the tightest live one, no pool that has been current is destroyed, and at the end the
    /// default pool is current and every capped pool a trimmed spare.
    #[test]
    fn every_drop_order_is_sound() {
        let limits = [300 * MIB, 100 * MIB, 200 * MIB];
        let orders = [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ];
        for order in orders {
            let f = Fake::new();
            let mut s = PoolState::default();
            let ids: Vec<u64> = limits.iter().map(|l| s.budget(&f, *l).unwrap()).collect();
            assert_eq!(s.cap(), Some(100 * MIB));
            let mut live: Vec<usize> = vec![0, 1, 2];
            for i in order {
                s.release(&f, ids[i]);
                live.retain(|x| *x != i);
                let want = live.iter().map(|j| limits[*j]).min();
                assert_eq!(s.cap(), want, "order {order:?} after dropping {i}");
                clean(&f);
            }
            assert_eq!(
                *f.current.borrow(),
                0,
                "{order:?}: the default pool is current"
            );
            all_spare(&f, &s);
            assert_eq!(s.spare_pools().len(), 3, "{order:?}: one spare per limit");
            assert_eq!(s.live_budgets(), 0);
        }
    }

    /// The cap in force is the tightest live budget's: a looser budget made inside a tighter one
    /// does not lift it, and takes over once the tighter one drops.
    #[test]
    fn the_tightest_live_budget_is_in_force() {
        let f = Fake::new();
        let mut s = PoolState::default();
        let tight = s.budget(&f, 64 * MIB).unwrap();
        let current_tight = *f.current.borrow();
        let loose = s.budget(&f, 512 * MIB).unwrap();
        assert_eq!(s.cap(), Some(64 * MIB));
        assert_eq!(*f.current.borrow(), current_tight);
        s.release(&f, tight);
        assert_eq!(s.cap(), Some(512 * MIB));
        assert_ne!(*f.current.borrow(), current_tight);
        s.release(&f, loose);
        assert_eq!(s.cap(), None);
        clean(&f);
        all_spare(&f, &s);
        // a budget of a limit used before reuses its pool: nothing new is created
        let created = f.live_pools();
        let again = s.budget(&f, 64 * MIB).unwrap();
        assert_eq!(*f.current.borrow(), current_tight);
        assert_eq!(f.live_pools(), created);
        s.release(&f, again);
        clean(&f);
        all_spare(&f, &s);
    }

    #[test]
    fn a_budget_of_zero_is_refused() {
        let f = Fake::new();
        let mut s = PoolState::<usize>::default();
        let e = s.budget(&f, 0).unwrap_err();
        assert!(e.to_string().contains("0 bytes"), "{e}");
        assert!(f.calls.borrow().is_empty());
    }

    /// Issue 26, point 8: a pool made by `budget` is destroyed when it cannot be made current.
    #[test]
    fn a_failed_install_does_not_leak_the_pool() {
        let f = Fake::new();
        let mut s = PoolState::default();
        *f.fail_set_current.borrow_mut() = 1;
        assert!(s.budget(&f, 64 * MIB).is_err());
        assert_eq!(f.live_pools(), 1, "{:?}", f.calls.borrow());
        assert_eq!(s.cap(), None);
        assert_eq!(*f.current.borrow(), 0);
        clean(&f);
        *f.fail_create.borrow_mut() = true;
        assert!(s.budget(&f, 64 * MIB).is_err());
        assert_eq!(s.live_budgets(), 0);
    }

    /// Issue 26, point 8: a failed restore keeps the state true (the capped pool is still current,
    /// its cap reported), and the pool is destroyed at the next switch that works.
    #[test]
    fn a_failed_restore_neither_leaks_nor_leaves_a_stale_cap() {
        let f = Fake::new();
        let mut s = PoolState::default();
        let b = s.budget(&f, 64 * MIB).unwrap();
        let capped = *f.current.borrow();
        *f.fail_set_current.borrow_mut() = 1;
        s.release(&f, b);
        // the driver still has the capped pool current: so says the state
        assert_eq!(*f.current.borrow(), capped);
        assert_eq!(s.cap(), Some(64 * MIB));
        assert!(s.spare_pools().is_empty(), "not spare while current");
        s.repair(&f);
        assert_eq!(*f.current.borrow(), 0);
        assert_eq!(s.cap(), None);
        assert_eq!(s.spare_pools(), vec![capped], "spare once replaced");
        clean(&f);
        all_spare(&f, &s);
        // and a new budget after a failed restore works
        let b = s.budget(&f, 32 * MIB).unwrap();
        s.release(&f, b);
        clean(&f);
        all_spare(&f, &s);
    }

    /// Issue 26, point 8: a builder install made while a budget is live is what is current once
    /// the budget drops (the old code restored the pool from before the budget).
    #[test]
    fn an_install_during_a_budget_survives_its_drop() {
        let f = Fake::new();
        let mut s = PoolState::default();
        let b = s.budget(&f, 64 * MIB).unwrap();
        s.install(&f, Some(8 << 30), Some(u64::MAX)).unwrap();
        assert_eq!(s.cap(), Some(64 * MIB), "the budget stays in force");
        s.release(&f, b);
        let installed = *f.current.borrow();
        assert_ne!(installed, 0);
        assert_eq!(s.cap(), Some(8 << 30));
        // a later budget comes back to the installed pool with its cap
        let b = s.budget(&f, 64 * MIB).unwrap();
        s.release(&f, b);
        assert_eq!(*f.current.borrow(), installed);
        assert_eq!(s.cap(), Some(8 << 30));
        clean(&f);
    }

    /// Two handles' budgets interleaved as two threads would: the shared state serialises them
    /// (the real-GPU test runs threads); any interleaving of makes and drops is sound.
    #[test]
    fn interleaved_budgets_in_many_orders_are_sound() {
        // a deterministic pseudo-random walk of makes and drops
        let f = Fake::new();
        let mut s = PoolState::default();
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if live.is_empty() || (x % 3 != 0 && live.len() < 6) {
                let limit = (x % 7 + 1) * MIB;
                live.push((s.budget(&f, limit).unwrap(), limit));
            } else {
                let (id, _) = live.remove((x as usize / 3) % live.len());
                s.release(&f, id);
            }
            assert_eq!(s.cap(), live.iter().map(|l| l.1).min());
        }
        for (id, _) in live {
            s.release(&f, id);
        }
        clean(&f);
        all_spare(&f, &s);
        // at most one pool per limit per budget live at once (7 limits, at most 6 live)
        assert!(s.spare_pools().len() <= 7 * 6, "{}", s.spare_pools().len());
        assert_eq!(*f.current.borrow(), 0);
    }

    /// The same walk with `cuDeviceSetMemPool` failing at random: never a destroyed pool used,
    /// the current pool never destroyed, and once the driver works again everything is restored
    /// and destroyed.
    #[test]
    fn random_switch_failures_are_sound() {
        let f = Fake::new();
        let mut s = PoolState::default();
        let mut live: Vec<u64> = Vec::new();
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for _ in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 5 == 0 {
                *f.fail_set_current.borrow_mut() = 1;
            }
            if live.is_empty() || (x % 3 != 0 && live.len() < 6) {
                if let Ok(id) = s.budget(&f, (x % 7 + 1) * MIB) {
                    live.push(id);
                }
            } else {
                let id = live.remove((x as usize / 3) % live.len());
                s.release(&f, id);
            }
            *f.fail_set_current.borrow_mut() = 0;
            clean(&f);
        }
        for id in live {
            s.release(&f, id);
        }
        s.repair(&f);
        clean(&f);
        all_spare(&f, &s);
        assert_eq!(*f.current.borrow(), 0);
        assert_eq!(s.cap(), None);
    }
}
