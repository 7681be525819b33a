//! The launcher's environment: which rank this process is, how many there are, and where rank 0
//! waits for the others ([`LaunchEnv`]).
//!
//! Read from torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), or, when `RANK` is not set, from SLURM's (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`; the address and port still come from `MASTER_ADDR` / `MASTER_PORT`, which
//! an sbatch script exports). oomguard's own variables:
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `OOMGUARD_RENDEZVOUS_PORT` | the TCP port rank 0 listens on for the NCCL id exchange | `MASTER_PORT + 1` |
//! | `OOMGUARD_RENDEZVOUS_TIMEOUT` | seconds a rank waits for the others to join | 120 |
//! | `OOMGUARD_NCCL_TIMEOUT` | seconds a collective may wait for the other ranks | 60 |
//! | `OOMGUARD_JOB_ID` | the job id every rank sends in its hello (rank 0 refuses other ids) | see below |
//!
//! The job id ([`LaunchEnv::job_id`]) keeps two jobs apart that share a rendezvous port (two
//! srun steps on one host with the same `MASTER_PORT`): rank 0 refuses a peer of another job,
//! with a reason, instead of giving it the NCCL id. It is `OOMGUARD_JOB_ID` when set, else
//! torchrun's run id `TORCHELASTIC_RUN_ID` (a fresh one per run with `--standalone`, else
//! `--rdzv-id`, whose default is `none`), else SLURM's `SLURM_JOB_ID`, with `.SLURM_STEP_ID`
//! appended when set (ranks started by several srun steps need one `OOMGUARD_JOB_ID`), else empty
//! (no job identity). A set variable that is empty, longer than 256 bytes or holds control
//! characters is an error that names it. The job id guards against accidents; it is not a secret
//! (the rendezvous is for trusted networks only).
//!
//! The CUDA device is `LOCAL_RANK`, or 0 when `CUDA_VISIBLE_DEVICES` names a single device.
//!
//! The rendezvous port is not `MASTER_PORT` itself: torchrun's agent on the first node already
//! listens there (since PyTorch 2.4 the c10d rendezvous's TCP store is shared with the workers,
//! which are told `TORCHELASTIC_USE_AGENT_STORE=True`; `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
//! turns that off), so rank 0 binds `MASTER_PORT + 1`. Set `OOMGUARD_RENDEZVOUS_PORT` (the same
//! value on every rank) when that port is taken.

use std::time::Duration;

use super::rendezvous::MAX_JOB_ID;
use crate::Error;

/// Which launcher's variables a [`LaunchEnv`] was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (`torch.distributed.run`) or any launcher that sets `RANK` and `WORLD_SIZE`.
    Torchrun,
    /// SLURM's srun (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
}

/// Default seconds a rank waits in the rendezvous for the others.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(120);
/// Default seconds a collective may wait for the other ranks before the communicator is aborted.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// This process's place in a data-parallel group, as the launcher described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher the variables came from.
    pub launcher: Launcher,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks (processes) in the group.
    pub world_size: usize,
    /// This process's index on its host.
    pub local_rank: usize,
    /// The CUDA device this process drives: `local_rank`, or 0 when `CUDA_VISIBLE_DEVICES`
    /// names exactly one device (a launcher that binds one GPU to each process, e.g. srun
    /// `--gpus-per-task=1`).
    pub device_ordinal: usize,
    /// The host of rank 0 (`MASTER_ADDR`).
    pub master_addr: String,
    /// The launcher's port on that host (`MASTER_PORT`).
    pub master_port: u16,
    /// The port rank 0 listens on for the NCCL id exchange.
    pub rendezvous_port: u16,
    /// How long the rendezvous waits for the other ranks.
    pub rendezvous_timeout: Duration,
    /// How long one collective may wait for the other ranks.
    pub collective_timeout: Duration,
    /// The job this rank belongs to, sent in the rendezvous hello: `OOMGUARD_JOB_ID`, else
    /// `TORCHELASTIC_RUN_ID`, else `SLURM_JOB_ID[.SLURM_STEP_ID]`, else empty.
    pub job_id: String,
}

impl LaunchEnv {
    /// Reads the process's environment; an error names the variable that is missing, unparsable
    /// or inconsistent with the others.
    pub fn from_env() -> Result<Self, Error> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `var` (the environment, or a map in tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let bad = |m: String| Error::InvalidArgument(m);
        let (launcher, rank_var, world_var, local_var) = if var("RANK").is_some() {
            (Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else if var("SLURM_PROCID").is_some() {
            (
                Launcher::Slurm,
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
            )
        } else {
            return Err(bad(
                "no launcher variables: RANK (torchrun) and SLURM_PROCID (srun) are both unset; \
                 start the program with torchrun or srun, or set RANK, WORLD_SIZE, LOCAL_RANK, \
                 MASTER_ADDR and MASTER_PORT"
                    .into(),
            ));
        };
        let required = |name: &str| {
            var(name)
                .map(|v| v.trim().to_string())
                .ok_or_else(|| bad(format!("{name} is not set ({rank_var} is)")))
        };
        let number = |name: &str| -> Result<usize, Error> {
            let v = required(name)?;
            v.parse::<usize>()
                .map_err(|_| bad(format!("{name}={v:?} is not a non-negative integer")))
        };
        let rank = number(rank_var)?;
        let world_size = number(world_var)?;
        if world_size == 0 {
            return Err(bad(format!(
                "{world_var}=0: a group needs at least one rank"
            )));
        }
        if world_size > super::rendezvous::MAX_WORLD {
            return Err(bad(format!(
                "{world_var}={world_size}: more ranks than the rendezvous serves (at most {})",
                super::rendezvous::MAX_WORLD
            )));
        }
        if rank >= world_size {
            return Err(bad(format!(
                "{rank_var}={rank} is not below {world_var}={world_size}"
            )));
        }
        let local_rank = number(local_var)?;
        if local_rank >= world_size {
            return Err(bad(format!(
                "{local_var}={local_rank} is not below {world_var}={world_size}"
            )));
        }
        if let Some(w) = var("LOCAL_WORLD_SIZE") {
            let w = w.trim();
            let w: usize = w
                .parse()
                .map_err(|_| bad(format!("LOCAL_WORLD_SIZE={w:?} is not an integer")))?;
            if local_rank >= w || w > world_size {
                return Err(bad(format!(
                    "LOCAL_WORLD_SIZE={w} is inconsistent with {local_var}={local_rank} and \
                     {world_var}={world_size}"
                )));
            }
        }
        let master_addr = required("MASTER_ADDR")?;
        if master_addr.is_empty() {
            return Err(bad("MASTER_ADDR is empty".into()));
        }
        // An IPv6 address in brackets (`[::1]`, as in a URL) is the address inside them.
        let master_addr = match master_addr
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
        {
            Some(inner) if inner.parse::<std::net::Ipv6Addr>().is_ok() => inner.to_string(),
            _ => master_addr,
        };
        if let Some((host, port)) = master_addr.rsplit_once(':') {
            // (an IPv6 address has colons too: only `name:digits` or `a.b.c.d:digits` is refused)
            if !host.contains(':') && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad(format!(
                    "MASTER_ADDR={master_addr:?} holds a port: set MASTER_ADDR={host:?} and the port in MASTER_PORT"
                )));
            }
        }
        let port = |name: &str, v: &str| -> Result<u16, Error> {
            match v.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(bad(format!("{name}={v:?} is not a TCP port (1..=65535)"))),
            }
        };
        let master_port = port("MASTER_PORT", &required("MASTER_PORT")?)?;
        let rendezvous_port = match var("OOMGUARD_RENDEZVOUS_PORT") {
            Some(v) => port("OOMGUARD_RENDEZVOUS_PORT", v.trim())?,
            None => master_port.checked_add(1).ok_or_else(|| {
                bad(
                    "MASTER_PORT=65535 leaves no port above it for the rendezvous: set \
                     OOMGUARD_RENDEZVOUS_PORT"
                        .into(),
                )
            })?,
        };
        let seconds = |name: &str, default: Duration| -> Result<Duration, Error> {
            match var(name) {
                None => Ok(default),
                Some(v) => parse_seconds(v.trim()).ok_or_else(|| {
                    bad(format!("{name}={v:?} is not a positive number of seconds"))
                }),
            }
        };
        let one_visible = var("CUDA_VISIBLE_DEVICES").is_some_and(|v| {
            let v = v.trim();
            !v.is_empty() && !v.contains(',')
        });
        Ok(Self {
            launcher,
            rank,
            world_size,
            local_rank,
            device_ordinal: if one_visible { 0 } else { local_rank },
            master_addr,
            master_port,
            rendezvous_port,
            rendezvous_timeout: seconds("OOMGUARD_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT)?,
            collective_timeout: seconds("OOMGUARD_NCCL_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT)?,
            job_id: job_id(&var)?,
        })
    }
}

/// The job id: the first of `OOMGUARD_JOB_ID`, `TORCHELASTIC_RUN_ID`,
/// `SLURM_JOB_ID[.SLURM_STEP_ID]` that is set, each checked; empty when none is.
fn job_id(var: &impl Fn(&str) -> Option<String>) -> Result<String, Error> {
    let checked = |name: &str| -> Result<Option<String>, Error> {
        let Some(v) = var(name) else { return Ok(None) };
        let v = v.trim();
        let problem = if v.is_empty() {
            Some("is empty".to_string())
        } else if v.len() > MAX_JOB_ID {
            Some(format!("is {} bytes long (at most {MAX_JOB_ID})", v.len()))
        } else if v.chars().any(char::is_control) {
            Some("holds control characters".to_string())
        } else {
            None
        };
        match problem {
            Some(p) => Err(Error::InvalidArgument(format!(
                "{name} {p}: it names the job in the rendezvous hello{}",
                if name == "OOMGUARD_JOB_ID" {
                    ""
                } else {
                    "; set OOMGUARD_JOB_ID (the same on every rank) to override it"
                }
            ))),
            None => Ok(Some(v.to_string())),
        }
    };
    if let Some(v) = checked("OOMGUARD_JOB_ID")? {
        return Ok(v);
    }
    if let Some(v) = checked("TORCHELASTIC_RUN_ID")? {
        return Ok(v);
    }
    let Some(job) = checked("SLURM_JOB_ID")? else {
        return Ok(String::new());
    };
    let id = match checked("SLURM_STEP_ID")? {
        Some(step) => format!("{job}.{step}"),
        None => job,
    };
    if id.len() > MAX_JOB_ID {
        return Err(Error::InvalidArgument(format!(
            "SLURM_JOB_ID.SLURM_STEP_ID is {} bytes long (at most {MAX_JOB_ID}); set \
             OOMGUARD_JOB_ID (the same on every rank) to override it",
            id.len()
        )));
    }
    Ok(id)
}

/// A positive, finite number of seconds (at most a day), e.g. `"30"` or `"0.5"`.
pub(crate) fn parse_seconds(v: &str) -> Option<Duration> {
    let s: f64 = v.parse().ok()?;
    (s.is_finite() && s > 0.0 && s <= 86_400.0).then(|| Duration::from_secs_f64(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv, Error> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| m.get(k).cloned())
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(over: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = TORCHRUN
            .iter()
            .filter(|(k, _)| !over.iter().any(|(o, _)| o == k))
            .copied()
            .collect();
        v.extend(over.iter().filter(|(_, val)| !val.is_empty()).copied());
        v
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        let e = env(pairs).unwrap_err().to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        e
    }

    #[test]
    fn torchrun_variables_are_read_with_the_port_above_master_port() {
        let e = env(TORCHRUN).unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!((e.rank, e.world_size, e.local_rank), (1, 2, 1));
        assert_eq!(e.device_ordinal, 1);
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("127.0.0.1", 29500)
        );
        assert_eq!(e.rendezvous_port, 29501);
        assert_eq!(e.collective_timeout, DEFAULT_COLLECTIVE_TIMEOUT);
        assert!(DEFAULT_COLLECTIVE_TIMEOUT <= Duration::from_secs(60));
        let e = env(&with(&[
            ("OOMGUARD_RENDEZVOUS_PORT", "40000"),
            ("OOMGUARD_NCCL_TIMEOUT", "2.5"),
            ("OOMGUARD_RENDEZVOUS_TIMEOUT", "7"),
        ]))
        .unwrap();
        assert_eq!(e.rendezvous_port, 40000);
        assert_eq!(e.collective_timeout, Duration::from_millis(2500));
        assert_eq!(e.rendezvous_timeout, Duration::from_secs(7));
    }

    #[test]
    fn slurm_variables_are_the_second_source() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "12000"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, 1));
        assert_eq!(e.device_ordinal, 1);
        assert_eq!(e.master_addr, "node7");
        let m = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
        assert!(m.contains("SLURM_LOCALID is not set"), "{m}");
    }

    #[test]
    fn one_visible_gpu_is_device_0_whatever_the_local_rank() {
        let e = env(&with(&[("CUDA_VISIBLE_DEVICES", "3")])).unwrap();
        assert_eq!((e.local_rank, e.device_ordinal), (1, 0));
        let e = env(&with(&[("CUDA_VISIBLE_DEVICES", "2,3")])).unwrap();
        assert_eq!(e.device_ordinal, 1);
    }

    #[test]
    fn missing_variables_are_named() {
        assert!(err(&[]).contains("RANK (torchrun) and SLURM_PROCID (srun) are both unset"));
        for var in ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
            let pairs: Vec<_> = TORCHRUN
                .iter()
                .filter(|(k, _)| *k != var)
                .copied()
                .collect();
            let m = err(&pairs);
            assert!(m.contains(&format!("{var} is not set")), "{var}: {m}");
        }
    }

    #[test]
    fn unparsable_and_inconsistent_values_are_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("RANK", "one")],
                "RANK=\"one\" is not a non-negative integer",
            ),
            (&[("RANK", "-1")], "RANK=\"-1\""),
            (&[("WORLD_SIZE", "0")], "WORLD_SIZE=0"),
            (&[("RANK", "2")], "RANK=2 is not below WORLD_SIZE=2"),
            (
                &[("LOCAL_RANK", "2")],
                "LOCAL_RANK=2 is not below WORLD_SIZE=2",
            ),
            (
                &[("LOCAL_WORLD_SIZE", "1")],
                "LOCAL_WORLD_SIZE=1 is inconsistent",
            ),
            (&[("LOCAL_WORLD_SIZE", "x")], "LOCAL_WORLD_SIZE=\"x\""),
            (
                &[("MASTER_PORT", "0")],
                "MASTER_PORT=\"0\" is not a TCP port",
            ),
            (&[("MASTER_PORT", "70000")], "MASTER_PORT=\"70000\""),
            (&[("MASTER_PORT", "65535")], "set OOMGUARD_RENDEZVOUS_PORT"),
            (&[("MASTER_ADDR", " ")], "MASTER_ADDR is empty"),
            (
                &[("OOMGUARD_RENDEZVOUS_PORT", "http")],
                "OOMGUARD_RENDEZVOUS_PORT=\"http\"",
            ),
            (
                &[("OOMGUARD_NCCL_TIMEOUT", "0")],
                "OOMGUARD_NCCL_TIMEOUT=\"0\"",
            ),
            (
                &[("OOMGUARD_NCCL_TIMEOUT", "inf")],
                "OOMGUARD_NCCL_TIMEOUT=\"inf\"",
            ),
            (
                &[("OOMGUARD_RENDEZVOUS_TIMEOUT", "-3")],
                "OOMGUARD_RENDEZVOUS_TIMEOUT",
            ),
            // a world the rendezvous cannot hold (it aborted allocating 2^32 slots)
            (
                &[("WORLD_SIZE", "4294967295")],
                "WORLD_SIZE=4294967295: more ranks than the rendezvous serves",
            ),
            (
                &[("MASTER_ADDR", "127.0.0.1:29500")],
                "MASTER_ADDR=\"127.0.0.1:29500\" holds a port: set MASTER_ADDR=\"127.0.0.1\"",
            ),
            (
                &[("MASTER_ADDR", "node7:29500")],
                "set MASTER_ADDR=\"node7\" and the port in MASTER_PORT",
            ),
        ];
        for (over, want) in cases {
            let m = err(&with(over));
            assert!(m.contains(want), "{over:?}: {m}");
        }
        // An IPv6 address in brackets is the address; one without them is taken as it is.
        assert_eq!(
            env(&with(&[("MASTER_ADDR", "[::1]")])).unwrap().master_addr,
            "::1"
        );
        assert_eq!(
            env(&with(&[("MASTER_ADDR", "::1")])).unwrap().master_addr,
            "::1"
        );
        assert_eq!(
            env(&with(&[("MASTER_ADDR", "fe80::1")]))
                .unwrap()
                .master_addr,
            "fe80::1"
        );
        // MASTER_PORT=65535 is fine with an explicit rendezvous port.
        let e = env(&with(&[
            ("MASTER_PORT", "65535"),
            ("OOMGUARD_RENDEZVOUS_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(e.rendezvous_port, 1234);
    }

    #[test]
    fn the_job_id_comes_from_the_launcher_and_is_checked() {
        assert_eq!(env(TORCHRUN).unwrap().job_id, "");
        let e = env(&with(&[("TORCHELASTIC_RUN_ID", "3f2a")])).unwrap();
        assert_eq!(e.job_id, "3f2a");
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "12000"),
            ("SLURM_JOB_ID", "81234"),
        ];
        assert_eq!(env(&slurm).unwrap().job_id, "81234");
        let mut step = slurm.to_vec();
        step.push(("SLURM_STEP_ID", "2"));
        assert_eq!(env(&step).unwrap().job_id, "81234.2");
        // OOMGUARD_JOB_ID wins over the launcher's.
        step.push(("OOMGUARD_JOB_ID", " mine "));
        assert_eq!(env(&step).unwrap().job_id, "mine");
        let e = env(&with(&[
            ("TORCHELASTIC_RUN_ID", "run"),
            ("OOMGUARD_JOB_ID", "over"),
        ]))
        .unwrap();
        assert_eq!(e.job_id, "over");

        let long = "x".repeat(MAX_JOB_ID + 1);
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![("OOMGUARD_JOB_ID", " ")], "OOMGUARD_JOB_ID is empty"),
            (
                vec![("TORCHELASTIC_RUN_ID", "a\u{7}b")],
                "TORCHELASTIC_RUN_ID holds control characters",
            ),
            (
                vec![("SLURM_JOB_ID", &long)],
                "SLURM_JOB_ID is 257 bytes long (at most 256)",
            ),
            (
                vec![("SLURM_JOB_ID", "1"), ("SLURM_STEP_ID", "")],
                "SLURM_STEP_ID is empty",
            ),
        ];
        for (over, want) in cases {
            let mut pairs: Vec<(&str, &str)> = TORCHRUN.to_vec();
            pairs.extend(over.iter().copied());
            let m = err(&pairs);
            assert!(m.contains(want), "{over:?}: {m}");
            if !want.starts_with("OOMGUARD_JOB_ID") {
                assert!(m.contains("set OOMGUARD_JOB_ID"), "{m}");
            }
        }
    }
}
