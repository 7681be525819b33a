//! How a step starts: its first plan (remembered, seeded or one size up) agreed by the ranks.

use std::fmt;

use crate::retry::classify::IsOom;
use crate::retry::commit;
use crate::retry::consensus::ConsensusError;
use crate::retry::decision::OK;
use crate::retry::last_report;
use crate::retry::memory::{Limits, MemoryKey};
use crate::retry::result::RetryError;
use crate::retry_report::{BatchPlan, RetryReport, StepMode};
use crate::Device;

use super::agree::FAILED_VOTE;
use super::config::RetryEngine;
use super::full_loop::FullLoop;
use super::retry_loop::RetryLoop;
use super::target::Target;

impl RetryEngine {
    pub(super) fn begin_on<E: IsOom + fmt::Display>(
        &self,
        key: MemoryKey,
        target: Target,
        batch: usize,
        micro_cap: Option<usize>,
    ) -> Result<RetryLoop<E>, RetryError<E>> {
        last_report::clear_last_report();
        if batch == 0 {
            // Other ranks wait for this rank in the starting agreement: take part, so that they
            // stop too instead of waiting forever.
            let mut v = FAILED_VOTE;
            let _ = self.agree(&mut v);
            return Err(RetryError::InvalidArgument(
                "a step of 0 rows: the batch must have at least one row".into(),
            ));
        }
        // A step starts: the source may serve a step that repeats from a fixed layout
        // (`MemorySource::mark_step`). Before the clock and the churn are read: what the mark
        // moves is the boundary's, not this step's.
        target.mark_step();
        let started = self.inner.clock.now();
        let mode = key.mode;

        // Starting plan: remembered limits (else the engine's seed), or one size up after
        // enough clean steps.
        let Remembered {
            limits,
            from_memory,
            seeded,
            mut regrow,
            clean_steps,
            memory_error,
        } = self.remembered_start(&key, batch, micro_cap);
        let capped = |p: BatchPlan| match micro_cap {
            Some(m) if m < p.micro_batch() => {
                BatchPlan::with_micro_batch(p.batch(), m).unwrap_or(p)
            }
            _ => p,
        };
        let good = capped(limits.plan_for(batch).expect("batch >= 1 gives a plan"));
        // Remembered limits that do not bind at this batch (a cap above it, or above the
        // caller's own cap) leave the plan what it would be without them: not "from memory".
        let from_memory = from_memory && Some(good) != Limits::NONE.plan_for(batch).map(capped);
        let up = regrow.and_then(|l| l.plan_for(batch)).map(capped);
        if up == Some(good) {
            // the caller's micro-batch cap already binds: nothing to grow into
            regrow = None;
        }
        let mut plan = up.filter(|_| regrow.is_some()).unwrap_or(good);
        let agreed = self
            .agree_to_start(plan, batch, &key)
            .map_err(RetryError::Consensus)?;
        if agreed != plan {
            // Another rank starts smaller: no regrow this step. A regrow this rank had due stays
            // due: ranks whose clean steps are out of step (one restarted) would otherwise
            // cancel each other's regrows for good, taking turns.
            if regrow.take().is_some() {
                self.memory().entry(&key).clean_steps = clean_steps;
            }
            plan = agreed;
        }
        let report = RetryReport {
            from_memory,
            memory_error,
            // what the first attempt starts with (not synchronised: a step's start must not
            // wait for the device)
            held_bytes: vec![target.bytes().0],
            // the first plan is the seed's (not a regrow's, nor a smaller one another rank has)
            seeded: seeded.filter(|_| regrow.is_none() && plan == good),
            ..RetryReport::starting(key.site.clone(), mode, batch, plan)
        };
        Ok(RetryLoop::full(FullLoop {
            device_addr: Device::thread_device_addr(),
            engine: self.clone(),
            churn_before: target.churn(),
            target,
            key,
            batch,
            good,
            plan,
            regrow,
            regrow_plan: regrow.map(|_| plan),
            report,
            failures: Vec::new(),
            oom_count: 0,
            last_too_large: None,
            started,
            attempt_started: started,
            commits_before: commit::commits(),
            done: false,
        }))
    }

    /// The ranks' agreement on the first plan: the smallest of every rank's `plan`; an error on
    /// every rank when one cannot start (an empty batch) or when a rank that keeps every row
    /// meets one whose plan drops rows.
    fn agree_to_start(
        &self,
        plan: BatchPlan,
        batch: usize,
        key: &MemoryKey,
    ) -> Result<BatchPlan, ConsensusError> {
        let agreed = self.agree_on(OK, plan, batch, key)?;
        if agreed.status != OK {
            return Err(ConsensusError(
                "another rank cannot start this step (an empty batch): every rank stops".into(),
            ));
        }
        if let Some(why) = agreed.conflict {
            return Err(ConsensusError(why.to_string()));
        }
        Ok(agreed.plan)
    }

    /// What is remembered for `key` as the step's starting limits: the remembered ones (a
    /// training step's batch cap ignored), else the engine's seed; with a regrow after enough
    /// clean steps.
    fn remembered_start(
        &self,
        key: &MemoryKey,
        batch: usize,
        micro_cap: Option<usize>,
    ) -> Remembered {
        let mode = key.mode;
        let mut mem = self.memory();
        let e = mem.entry(key);
        let mut limits = e.limits;
        if mode == StepMode::Train && limits.batch.is_some() {
            // A training step never runs fewer rows than asked because of a remembered batch
            // cap (from a plan file, or a policy that shrank): only micro-batch caps apply.
            tracing::warn!(
                target: "oomguard::retry",
                site = %key.site,
                limits = %limits,
                "a remembered batch cap is ignored for a training step (it would drop rows)"
            );
            limits.batch = None;
        }
        let from_memory = limits != Limits::NONE;
        // Nothing remembered: the engine's seed stands for what would be.
        let seeded = self
            .inner
            .start_from
            .map(|m| {
                self.inner
                    .start_finder
                    .as_ref()
                    .map_or(m, |f| f.micro_batch_for(batch))
            })
            .filter(|&m| {
                !from_memory && !e.seed_outgrown && m < batch && micro_cap.is_none_or(|c| m < c)
            });
        if let Some(m) = seeded {
            limits.micro_batch = Some(m);
        }
        let mut regrow = None;
        let clean_steps = e.clean_steps;
        if let Some(k) = self.inner.regrow_after {
            let wait = u64::from(k) << e.failed_regrows.min(16);
            if u64::from(e.clean_steps) >= wait {
                e.clean_steps = 0;
                regrow = limits.one_up(batch);
            }
        }
        Remembered {
            limits,
            from_memory,
            seeded,
            regrow,
            clean_steps,
            memory_error: mem.error().map(str::to_string),
        }
    }
}

/// The starting limits of a step ([`RetryEngine::remembered_start`]).
struct Remembered {
    limits: Limits,
    /// The limits were remembered (not the engine's seed).
    from_memory: bool,
    /// The micro-batch of the engine's seed, when it stands for what is not remembered.
    seeded: Option<usize>,
    /// The limits one size up, when a regrow is due.
    regrow: Option<Limits>,
    /// The key's clean steps before a due regrow reset them (restored when the ranks cancel it).
    clean_steps: u32,
    /// The plan file's error, to report.
    memory_error: Option<String>,
}
