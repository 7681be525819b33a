//! The NCCL id exchange and the ranks' liveness links, over plain TCP: nothing beyond what the
//! launcher already gives (rank 0's host and a port), no shared filesystem, any number of hosts.
//!
//! Rank 0 listens on `host:port`; every other rank connects (retrying until the deadline while
//! rank 0 is not up yet) and sends a hello: its rank, the world size it was told and its job id
//! (the launcher's run or job id, see [`super::LaunchEnv::job_id`]). Rank 0 answers a hello it
//! accepts at once with a "waiting" frame, and when all `world_size - 1` ranks have said hello it
//! sends each the 128-byte NCCL unique id.
//!
//! Rank 0 serves every pending connection at once (non-blocking sockets, one thread): a
//! connection that has not said hello within 5 s is dropped, and connections that never speak
//! do not delay the ranks that do. A hello rank 0 cannot accept (another job id, another world
//! size, a rank out of range, a rank that already joined, another protocol version) is refused to
//! that peer alone, with a reject frame that says why; the rendezvous goes on, and if it times out
//! rank 0's error lists what it refused. When rank 0 gives up, every connection it holds (joined,
//! or still waiting to say hello) is told why.
//!
//! Every message is a frame: `b"OOMG"`, a version byte (2), a kind byte, a big-endian `u16`
//! payload length (at most 1024), the payload. That header is the same in every version, so a
//! peer of another version is still read whole and refused in its own version's framing (version 1
//! had no job id and no waiting frame).
//!
//! The connections stay open afterwards as liveness links ([`PeerLinks`]): a rank that drops
//! its communicator says goodbye, a rank whose process dies closes its sockets (the kernel does it,
//! even after `kill -9`), and rank 0 tells the other ranks. A collective that waits for a rank
//! reported gone is aborted (see [`super::NcclConsensus`]) instead of waiting for its timeout.
//!
//! # Trust model
//!
//! As torchrun's TCP store, the rendezvous is for trusted networks only. There is no
//! authentication and no encryption: any process that can reach the port can read the NCCL id
//! (by claiming a missing rank), take a rank's place, or keep rank 0 waiting until its timeout by
//! never sending the last hello. The job id keeps two jobs that share a port apart by accident;
//! it is not a secret. What the design does bound is the harm of a peer that is merely not a
//! rank: rank 0 binds the loopback address when `MASTER_ADDR` is one or `localhost` (a
//! single-host run is not reachable from outside; a host name that resolves to loopback only on
//! rank 0's machine binds every interface, as other machines reach it by its real address),
//! reads at most 1 KiB per frame (a longer text it sends is cut and ends with `[cut]`), holds
//! at most 256 connections that have not said hello (the oldest is dropped first) each for at
//! most 5 s, keeps the first three refusals' reasons and a count, serves at most
//! [`MAX_WORLD`] ranks, and never lets a stray or malformed hello end the rendezvous.

use std::collections::VecDeque;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::backend::{BackendError, BackendErrorKind};
use crate::Error;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;
/// The longest job id a hello carries, in bytes.
pub const MAX_JOB_ID: usize = 256;

const MAGIC: &[u8; 4] = b"OOMG";
/// 2: the hello carries a job id, and rank 0 acknowledges it with a waiting frame.
const VERSION: u8 = 2;
const HEADER: usize = 8;
const MAX_PAYLOAD: usize = 1024;

const HELLO: u8 = 1;
const ID: u8 = 2;
const REJECT: u8 = 3;
const BYE: u8 = 4;
const GONE: u8 = 5;
const WAITING: u8 = 6;

/// How long rank 0 waits for a connected peer's hello before dropping the connection.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// Connections rank 0 holds that have not said hello yet; beyond it the oldest is dropped.
const MAX_PENDING: usize = 256;
/// Connections rank 0 accepts in one pass before it reads the ones it holds.
const ACCEPTS_PER_PASS: usize = 64;
/// How long rank 0 sleeps when a pass found nothing to do.
const POLL: Duration = Duration::from_millis(5);
/// How long rank 0, unable to bind its port, asks the holder who it is.
const PROBE_WAIT: Duration = Duration::from_secs(2);
/// How many refused peers rank 0's timeout message names (the rest are counted).
const NAMED_REFUSALS: usize = 3;
/// How many missing ranks rank 0's timeout message names (the rest are counted).
const NAMED_MISSING: usize = 32;
/// The most ranks a rendezvous serves (rank 0 holds a slot per rank).
pub const MAX_WORLD: usize = 1 << 20;
/// How often a liveness reader wakes up to see whether its links are closing.
const READER_TICK: Duration = Duration::from_millis(200);

/// Where and how a rank meets the others.
#[derive(Clone, Debug)]
pub struct RendezvousConfig {
    /// Rank 0's host (`MASTER_ADDR`): a name or an address.
    pub host: String,
    /// The port rank 0 listens on.
    pub port: u16,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// How long to wait for the others (rank 0) or for rank 0 (the others).
    pub timeout: Duration,
    /// The job this rank belongs to (at most [`MAX_JOB_ID`] bytes; empty when the launcher gives
    /// none): rank 0 refuses a peer whose job id differs, so two jobs that share a port do not
    /// mix. Not a secret (see the module's trust model).
    pub job_id: String,
}

/// What a rendezvous gives a rank: the group's NCCL id and the liveness links.
#[derive(Debug)]
pub struct Rendezvous {
    /// The NCCL unique id rank 0 made (the same bytes on every rank).
    pub id: [u8; ID_BYTES],
    /// The links to the other ranks (rank 0: one per rank; the others: one to rank 0).
    pub links: PeerLinks,
}

/// A rendezvous failure: `device error: rendezvous: ...` (a [`BackendError`] of kind `Other`).
fn err(m: String) -> Error {
    Error::Backend(BackendError::new(BackendErrorKind::Other, "rendezvous", m))
}

/// Meets the other ranks: rank 0 makes the id with `make_id` (called on rank 0 only) and sends
/// it to every other rank. Returns when every rank has the id, or an error within
/// `cfg.timeout` (plus at most a few seconds of connection set-up).
pub fn rendezvous(
    cfg: &RendezvousConfig,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], Error>,
) -> Result<Rendezvous, Error> {
    if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
        return Err(err(format!(
            "rank {} of a world of {}",
            cfg.rank, cfg.world_size
        )));
    }
    if cfg.world_size > MAX_WORLD {
        return Err(err(format!(
            "a world of {} ranks (the rendezvous serves at most {MAX_WORLD})",
            cfg.world_size
        )));
    }
    if cfg.timeout.is_zero() {
        return Err(err("the timeout is zero".into()));
    }
    if cfg.job_id.len() > MAX_JOB_ID {
        return Err(err(format!(
            "a job id of {} bytes (at most {MAX_JOB_ID})",
            cfg.job_id.len()
        )));
    }
    if cfg.rank == 0 {
        let id = make_id()?;
        serve(cfg, id, Limits::DEFAULT)
    } else {
        join(cfg)
    }
}

/// The address rank 0 binds: the loopback address when `host` is one (a literal loopback
/// address, or `localhost`: a single-host run is not reachable from outside), else every
/// interface of `host`'s family. A host name that resolves to loopback here only (Debian maps
/// its own name to 127.0.1.1) is another machine's way to reach this one: every interface.
fn bind_addr(cfg: &RendezvousConfig) -> Result<SocketAddr, Error> {
    let addrs: Vec<SocketAddr> = (cfg.host.as_str(), cfg.port)
        .to_socket_addrs()
        .map_err(|e| err(format!("cannot resolve rank 0's host {:?}: {e}", cfg.host)))?
        .collect();
    let literal = cfg.host.parse::<IpAddr>().is_ok();
    if literal || cfg.host.eq_ignore_ascii_case("localhost") {
        if let Some(a) = addrs.iter().find(|a| a.ip().is_loopback()) {
            return Ok(*a);
        }
    }
    let ip = match addrs.first() {
        Some(a) if a.is_ipv6() => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    Ok(SocketAddr::new(ip, cfg.port))
}

fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

/// Rank 0's bounds on the connections it serves (smaller in tests).
#[derive(Clone, Copy, Debug)]
struct Limits {
    hello_wait: Duration,
    max_pending: usize,
}

impl Limits {
    const DEFAULT: Self = Self {
        hello_wait: HELLO_WAIT,
        max_pending: MAX_PENDING,
    };
}

/// A connection rank 0 accepted that has not said hello yet.
struct Pending {
    s: TcpStream,
    from: SocketAddr,
    buf: Vec<u8>,
    until: Instant,
}

/// What reading a pending connection gave.
enum Heard {
    /// Nothing whole yet, and its time is not up.
    Nothing,
    /// A whole frame: version, kind, payload.
    Frame(u8, u8, Vec<u8>),
    /// It sent nothing in time, or something that is not a frame: why.
    Unusable(String),
    /// It closed the connection.
    Closed,
}

/// Reads what a pending connection (non-blocking) has sent so far, at most one frame.
fn hear(p: &mut Pending, now: Instant, hello_wait: Duration) -> Heard {
    let mut chunk = [0u8; 256];
    // Each read takes at least one byte of a frame of at most 1032 bytes: bounded.
    loop {
        match parse_frame(&p.buf) {
            Err(m) => return Heard::Unusable(format!("sent bytes that are not a frame ({m})")),
            Ok(Some(f)) => return Heard::Frame(f.version, f.kind, f.payload),
            Ok(None) => {}
        }
        let n = frame_want(&p.buf).min(chunk.len());
        match p.s.read(&mut chunk[..n]) {
            Ok(0) => return Heard::Closed,
            Ok(n) => p.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                return if now >= p.until {
                    Heard::Unusable(format!(
                        "sent no hello within {:.1} s",
                        hello_wait.as_secs_f64()
                    ))
                } else {
                    Heard::Nothing
                };
            }
            Err(_) => return Heard::Closed,
        }
    }
}

/// Tells a peer why rank 0 is done with it (in the peer's protocol version) and closes. Unread
/// input is drained first, so that the close does not reset the connection before the peer has
/// read the reason.
fn refuse(mut s: TcpStream, version: u8, why: &str) {
    let _ = s.set_nonblocking(true);
    let mut b = [0u8; 1024];
    for _ in 0..64 {
        match s.read(&mut b) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    let _ = s.set_nonblocking(false);
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    let _ = write_frame_as(&mut s, version, REJECT, why.as_bytes());
    let _ = s.shutdown(Shutdown::Write);
}

/// Rank 0's state while it waits for the others.
struct Serving<'a> {
    cfg: &'a RendezvousConfig,
    addr: SocketAddr,
    peers: Vec<Option<(TcpStream, SocketAddr)>>,
    joined: usize,
    pending: VecDeque<Pending>,
    /// Why the first peers were refused (named in the timeout message; at most
    /// [`NAMED_REFUSALS`] kept), and how many were.
    refused: Vec<String>,
    refusals: usize,
    /// Ranks that joined and left before the group was complete (their own timeout, a stopped
    /// process): not missing in the sense of never having come.
    left: Vec<usize>,
    /// Connections dropped because they sent no hello in time, or not a frame.
    silent: usize,
    /// The first error `accept` gave (the loop goes on: a full fd table is no reason to stop).
    accept_error: Option<String>,
    /// Warnings logged about peers so far (a flood of them is counted, not logged).
    warned: usize,
}

/// Warnings about dropped or refused peers that rank 0 logs; the rest are counted in its
/// timeout message.
const LOGGED_WARNINGS: usize = 20;

impl Serving<'_> {
    fn warn(&mut self, m: String) {
        self.warned += 1;
        if self.warned <= LOGGED_WARNINGS {
            tracing::warn!("rendezvous: {m}");
        }
        if self.warned == LOGGED_WARNINGS {
            tracing::warn!("rendezvous: further dropped or refused peers are not logged");
        }
    }

    /// Accepts what is queued on the listener (at most `n`), as pending connections.
    fn accept(
        &mut self,
        listener: &TcpListener,
        limits: Limits,
        deadline: Instant,
        n: usize,
    ) -> bool {
        let mut any = false;
        for _ in 0..n {
            let (s, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => {
                    if self.accept_error.is_none() {
                        tracing::warn!("rendezvous: accept on {}: {e}", self.addr);
                        self.accept_error = Some(e.to_string());
                    }
                    break;
                }
            };
            any = true;
            if s.set_nonblocking(true)
                .and_then(|()| s.set_nodelay(true))
                .is_err()
            {
                continue;
            }
            if self.pending.len() >= limits.max_pending {
                if let Some(old) = self.pending.pop_front() {
                    self.warn(format!(
                        "{} connections without a hello; dropped the oldest, from {}",
                        limits.max_pending, old.from
                    ));
                    self.silent += 1;
                    refuse(
                        old.s,
                        VERSION,
                        "too many connections without a hello; this one is the oldest",
                    );
                }
            }
            let until = (Instant::now() + limits.hello_wait).min(deadline);
            self.pending.push_back(Pending {
                s,
                from,
                buf: Vec::new(),
                until,
            });
        }
        any
    }

    fn refuse_peer(&mut self, s: TcpStream, version: u8, why: String) {
        self.warn(format!("refused a peer: {why}"));
        refuse(s, version, &why);
        self.refusals += 1;
        if self.refused.len() < NAMED_REFUSALS {
            self.refused.push(why);
        }
    }

    /// Settles a pending connection that said something (or nothing in time).
    fn settle(&mut self, p: Pending, heard: Heard) {
        let from = p.from;
        match heard {
            Heard::Nothing => {}
            Heard::Closed => {}
            Heard::Unusable(why) => {
                self.warn(format!("dropped a connection from {from} that {why}"));
                self.silent += 1;
                refuse(p.s, VERSION, &format!("this connection {why}"));
            }
            Heard::Frame(version, _, _) if version != VERSION => {
                let why = format!(
                    "the peer from {from} speaks rendezvous protocol version {version}, rank 0 \
                     on {} version {VERSION}: every rank must run the same oomguard version",
                    self.addr
                );
                self.refuse_peer(p.s, version, why);
            }
            Heard::Frame(_, HELLO, payload) => match self.check_hello(from, &payload) {
                Err(why) => self.refuse_peer(p.s, VERSION, why),
                Ok(rank) => {
                    let mut s = p.s;
                    let waiting = format!(
                        "rank 0 has {} of {} ranks",
                        self.joined + 1,
                        self.cfg.world_size
                    );
                    if write_frame(&mut s, WAITING, waiting.as_bytes()).is_ok() {
                        self.peers[rank] = Some((s, from));
                        self.joined += 1;
                        self.left.retain(|&r| r != rank);
                    }
                }
            },
            Heard::Frame(_, kind, _) => {
                let why =
                    format!("the peer from {from} sent a frame of kind {kind} before its hello");
                self.refuse_peer(p.s, VERSION, why);
            }
        }
    }

    /// The rank a hello claims, or why it is refused.
    fn check_hello(&mut self, from: SocketAddr, p: &[u8]) -> Result<usize, String> {
        let (world, addr, ours) = (self.cfg.world_size, self.addr, &self.cfg.job_id);
        if p.len() < 8 || p.len() > 8 + MAX_JOB_ID {
            return Err(format!(
                "the peer from {from} sent a hello of {} bytes",
                p.len()
            ));
        }
        let (rank, their_world) = (be32(&p[0..4]), be32(&p[4..8]));
        let job = String::from_utf8_lossy(&p[8..]);
        if job != *ours {
            return Err(format!(
                "job id mismatch: rank 0 on {addr} serves job {ours:?}, the peer from {from} \
                 (rank {rank}) belongs to job {job:?}; two jobs share this port: give each its \
                 own MASTER_PORT or OOMGUARD_RENDEZVOUS_PORT (if they are one job, e.g. ranks of \
                 several srun steps, set OOMGUARD_JOB_ID to one value on every rank)"
            ));
        }
        if their_world != world {
            return Err(format!(
                "rank {rank} (from {from}) was started with a world size of {their_world}, rank 0 \
                 with {world}"
            ));
        }
        if rank == 0 {
            return Err(format!(
                "the peer from {from} says it is rank 0 of job {ours:?}, which the process \
                 listening on {addr} already is: two processes were started as rank 0 (check \
                 RANK / SLURM_PROCID), or two runs share one job id and port"
            ));
        }
        if rank >= world {
            return Err(format!(
                "a peer from {from} says it is rank {rank} of {world}"
            ));
        }
        if self.peers[rank].is_some() {
            // The rank that joined may have gone since (a restarted process): free its place.
            self.check_joined(rank);
        }
        if let Some((_, first)) = &self.peers[rank] {
            return Err(format!(
                "rank {rank} joined twice (first from {first}, again from {from}): is a second \
                 process running as rank {rank}?"
            ));
        }
        Ok(rank)
    }

    /// Frees the place of a joined rank whose connection closed (or that spoke out of turn).
    fn check_joined(&mut self, rank: usize) -> bool {
        let Some((s, from)) = &mut self.peers[rank] else {
            return false;
        };
        let mut b = [0u8; 64];
        let why = match s.read(&mut b) {
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                return false
            }
            Ok(0) | Err(_) => None,
            Ok(_) => Some(format!("rank {rank} (from {from}) sent data before the id")),
        };
        let Some((s, from)) = self.peers[rank].take() else {
            return false;
        };
        self.joined -= 1;
        if !self.left.contains(&rank) {
            self.left.push(rank);
        }
        self.warn(format!(
            "rank {rank} (from {from}) left before the id was sent; waiting for it again"
        ));
        if let Some(why) = why {
            self.refuse_peer(s, VERSION, why);
        }
        true
    }

    /// The timeout: every connection rank 0 holds, or finds queued, is told why.
    fn give_up(mut self, listener: &TcpListener, limits: Limits, deadline: Instant) -> Error {
        let world = self.cfg.world_size;
        let missing = (1..world).filter(|r| self.peers[*r].is_none() && !self.left.contains(r));
        let mut m = format!(
            "timed out after {:.1} s on {}: {} of {world} ranks joined, missing rank(s) {}",
            self.cfg.timeout.as_secs_f64(),
            self.addr,
            self.joined,
            name_some(missing, NAMED_MISSING)
        );
        if !self.left.is_empty() {
            m += &format!(
                "; rank(s) {} joined and left before the group was complete (a shorter timeout \
                 than rank 0's, or a stopped process)",
                name_some(self.left.iter().copied(), NAMED_MISSING)
            );
        }
        if self.refusals > 0 {
            m += &format!("; refused {} peer(s): ", self.refusals);
            m += &self.refused.join("; ");
            if self.refusals > self.refused.len() {
                m += "; ...";
            }
        }
        if self.silent > 0 {
            m += &format!(
                "; dropped {} connection(s) that sent no hello (nothing in time, or not a frame)",
                self.silent
            );
        }
        if let Some(e) = &self.accept_error {
            m += &format!("; accept failed: {e}");
        }
        // Ranks still queued on the listener get the reason too, not a bare close.
        self.accept(listener, limits, deadline, limits.max_pending);
        for p in self.pending.drain(..) {
            refuse(p.s, VERSION, &m);
        }
        for (s, _) in self.peers.drain(..).flatten() {
            refuse(s, VERSION, &m);
        }
        err(m)
    }
}

/// The first `most` of `items`, comma-separated, then how many more there are (`none`: no item).
fn name_some(items: impl Iterator<Item = usize>, most: usize) -> String {
    let (mut named, mut more) = (Vec::new(), 0usize);
    for i in items {
        if named.len() < most {
            named.push(i.to_string());
        } else {
            more += 1;
        }
    }
    if named.is_empty() {
        return "none".into();
    }
    let mut out = named.join(", ");
    if more > 0 {
        out += &format!(" and {more} more");
    }
    out
}

/// Why rank 0 cannot bind its port, with what holds it when that can be learnt.
fn bind_failure(cfg: &RendezvousConfig, addr: SocketAddr, e: &io::Error) -> String {
    let mut m = format!("rank 0 cannot listen on {addr}: {e}");
    if e.kind() == ErrorKind::AddrInUse {
        m += &match probe(cfg) {
            // The answer says whether it is another job or a second rank 0 of this one.
            Some(answer) => format!(
                "; an oomguard rendezvous already listens there and answered this process's \
                 hello: {answer}"
            ),
            None => "; the process that holds the port does not answer as an oomguard \
                     rendezvous of this version (another service, or another job's rank 0 of \
                     another oomguard version): give each job its own port (MASTER_PORT, or \
                     OOMGUARD_RENDEZVOUS_PORT, the same on every rank of a job)"
                .into(),
        };
    } else {
        m += " (set OOMGUARD_RENDEZVOUS_PORT to a free port, the same on every rank)";
    }
    m
}

/// Says hello as rank 0 to whoever holds the port: an oomguard rank 0 refuses it with a reason
/// that says whether it is another job or a second rank 0 of this one.
fn probe(cfg: &RendezvousConfig) -> Option<String> {
    let at = format!("{}:{}", cfg.host, cfg.port);
    let mut s = connect(&at, PROBE_WAIT).ok()?;
    write_frame(
        &mut s,
        HELLO,
        &hello_payload(0, cfg.world_size, &cfg.job_id),
    )
    .ok()?;
    match read_frame(&mut s, &mut Vec::new(), Some(PROBE_WAIT)) {
        Frame::Msg(REJECT, p) | Frame::OtherVersion(_, REJECT, p) => {
            Some(String::from_utf8_lossy(&p).into_owned())
        }
        _ => None,
    }
}

fn hello_payload(rank: usize, world: usize, job_id: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + job_id.len());
    p.extend_from_slice(&(rank as u32).to_be_bytes());
    p.extend_from_slice(&(world as u32).to_be_bytes());
    p.extend_from_slice(job_id.as_bytes());
    p
}

fn serve(cfg: &RendezvousConfig, id: [u8; ID_BYTES], limits: Limits) -> Result<Rendezvous, Error> {
    let world = cfg.world_size;
    if world == 1 {
        return Ok(Rendezvous {
            id,
            links: PeerLinks::start(0, Vec::new()),
        });
    }
    let addr = bind_addr(cfg)?;
    let listener = TcpListener::bind(addr).map_err(|e| err(bind_failure(cfg, addr, &e)))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| err(format!("listen socket: {e}")))?;
    let deadline = Instant::now() + cfg.timeout;
    let mut st = Serving {
        cfg,
        addr,
        peers: (0..world).map(|_| None).collect(),
        joined: 1,
        pending: VecDeque::new(),
        refused: Vec::new(),
        refusals: 0,
        left: Vec::new(),
        silent: 0,
        accept_error: None,
        warned: 0,
    };
    while st.joined < world {
        let now = Instant::now();
        let Some(left) = remaining(deadline) else {
            return Err(st.give_up(&listener, limits, deadline));
        };
        let mut busy = st.accept(&listener, limits, deadline, ACCEPTS_PER_PASS);
        let mut i = 0;
        while i < st.pending.len() {
            match hear(&mut st.pending[i], now, limits.hello_wait) {
                Heard::Nothing => i += 1,
                heard => {
                    busy = true;
                    if let Some(p) = st.pending.remove(i) {
                        st.settle(p, heard);
                    }
                }
            }
        }
        for rank in 1..world {
            busy |= st.check_joined(rank);
        }
        if !busy {
            thread::sleep(left.min(POLL));
        }
    }
    let done = format!("the group on {addr} is complete: all {world} ranks joined");
    for p in st.pending.drain(..) {
        refuse(p.s, VERSION, &done);
    }
    let mut payload = Vec::with_capacity(4 + ID_BYTES);
    payload.extend_from_slice(&(world as u32).to_be_bytes());
    payload.extend_from_slice(&id);
    let mut links = Vec::with_capacity(world - 1);
    for (rank, peer) in st.peers.drain(..).enumerate() {
        let Some((mut s, _)) = peer else { continue };
        s.set_nonblocking(false)
            .and_then(|()| write_frame(&mut s, ID, &payload))
            .map_err(|e| err(format!("sending the id to rank {rank}: {e}")))?;
        links.push((rank, s));
    }
    Ok(Rendezvous {
        id,
        links: PeerLinks::start(0, links),
    })
}

fn join(cfg: &RendezvousConfig) -> Result<Rendezvous, Error> {
    let deadline = Instant::now() + cfg.timeout;
    let at = format!("{}:{}", cfg.host, cfg.port);
    let secs = cfg.timeout.as_secs_f64();
    let mut last = String::from("no attempt");
    let mut s = loop {
        let Some(left) = remaining(deadline) else {
            return Err(err(format!(
                "timed out after {secs:.1} s: rank 0 never answered at {at} (last: {last}); is \
                 rank 0 running, and are MASTER_ADDR, MASTER_PORT and OOMGUARD_RENDEZVOUS_PORT \
                 the same on every rank?"
            )));
        };
        match connect(&at, left) {
            Ok(s) => break s,
            Err(e) => {
                last = e;
                thread::sleep(left.min(Duration::from_millis(100)));
            }
        }
    };
    write_frame(
        &mut s,
        HELLO,
        &hello_payload(cfg.rank, cfg.world_size, &cfg.job_id),
    )
    .map_err(|e| err(format!("sending hello to rank 0 at {at}: {e}")))?;
    let mut buf = Vec::new();
    // Whether rank 0 accepted the hello (a waiting frame): a peer that never does is not one.
    let mut waiting = false;
    // What rank 0 said when it accepted this rank ("rank 0 has 2 of 3 ranks").
    let mut last_waiting = String::new();
    loop {
        let frame = match remaining(deadline) {
            Some(left) => read_frame(&mut s, &mut buf, Some(left)),
            None => Frame::TimedOut,
        };
        return match frame {
            Frame::Msg(WAITING, p) => {
                waiting = true;
                last_waiting = String::from_utf8_lossy(&p).into_owned();
                continue;
            }
            Frame::Msg(ID, p) if p.len() == 4 + ID_BYTES => {
                let world = be32(&p[..4]);
                if world != cfg.world_size {
                    return Err(err(format!(
                        "rank 0 at {at} has a world size of {world}, this rank {}",
                        cfg.world_size
                    )));
                }
                let mut id = [0u8; ID_BYTES];
                id.copy_from_slice(&p[4..]);
                Ok(Rendezvous {
                    id,
                    links: PeerLinks::start(cfg.rank, vec![(0, s)]),
                })
            }
            Frame::Msg(REJECT, p) | Frame::OtherVersion(_, REJECT, p) => Err(err(format!(
                "rank 0 at {at} refused rank {}: {}",
                cfg.rank,
                String::from_utf8_lossy(&p)
            ))),
            Frame::OtherVersion(v, _, _) => Err(err(format!(
                "rank 0 at {at} speaks rendezvous protocol version {v}, this rank version \
                 {VERSION}: every rank must run the same oomguard version"
            ))),
            Frame::Msg(kind, _) => Err(err(format!(
                "rank 0 at {at} sent an unexpected message (kind {kind})"
            ))),
            Frame::TimedOut if waiting => Err(err(format!(
                "timed out after {secs:.1} s waiting for rank 0 at {at} to send the id (rank 0 \
                 accepted this rank: \"{last_waiting}\" when it did; the other ranks did not \
                 all join: rank 0's own error names the missing ones)"
            ))),
            Frame::TimedOut => Err(err(format!(
                "{at} accepted the connection but never answered this rank's hello in {secs:.1} \
                 s: it is not an oomguard rank 0, or one that is stalled (another service on \
                 that port? set OOMGUARD_RENDEZVOUS_PORT, the same on every rank)"
            ))),
            Frame::Closed if waiting => Err(err(format!(
                "rank 0 at {at} closed the connection before sending the id (its process exited?)"
            ))),
            Frame::Closed => Err(err(format!(
                "{at} closed the connection without answering this rank's hello: an oomguard \
                 rank 0 of an older version (every rank must run the same version), or another \
                 service on that port"
            ))),
            Frame::Broken(m) => Err(err(format!(
                "{at} does not speak oomguard's rendezvous ({m}): is another service on that \
                 port? (set OOMGUARD_RENDEZVOUS_PORT)"
            ))),
        };
    }
}

fn connect(at: &str, left: Duration) -> Result<TcpStream, String> {
    let addrs = at.to_socket_addrs().map_err(|e| e.to_string())?;
    let mut last = String::from("no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(2))) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(last)
}

fn be32(b: &[u8]) -> usize {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
}

/// What reading one frame gave.
#[derive(Debug)]
enum Frame {
    /// A frame of this protocol version: kind and payload.
    Msg(u8, Vec<u8>),
    /// A whole frame of another version: version, kind, payload.
    OtherVersion(u8, u8, Vec<u8>),
    /// Nothing (or not all of it) came in time.
    TimedOut,
    /// The peer closed the connection (or it was reset).
    Closed,
    /// Bytes that are not a frame of this protocol, or a socket error.
    Broken(String),
}

fn write_frame(s: &mut TcpStream, kind: u8, payload: &[u8]) -> io::Result<()> {
    write_frame_as(s, VERSION, kind, payload)
}

/// Writes a frame marked with `version` (a reject to a peer of another version is written in
/// its version, so that it can read it).
fn write_frame_as(s: &mut TcpStream, version: u8, kind: u8, payload: &[u8]) -> io::Result<()> {
    let payload = fit_payload(payload);
    let len = payload.len();
    let mut buf = Vec::with_capacity(HEADER + len);
    buf.extend_from_slice(MAGIC);
    buf.push(version);
    buf.push(kind);
    buf.extend_from_slice(&(len as u16).to_be_bytes());
    buf.extend_from_slice(&payload);
    s.write_all(&buf)
}

/// A payload of at most [`MAX_PAYLOAD`] bytes: a longer text is cut at a character boundary
/// and ends with " [cut]", so that the reader knows.
fn fit_payload(payload: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if payload.len() <= MAX_PAYLOAD {
        return payload.into();
    }
    const MARK: &[u8] = b" [cut]";
    let mut end = MAX_PAYLOAD - MARK.len();
    // (a UTF-8 continuation byte is 0b10xx_xxxx: back up to the start of its character)
    while end > 0 && payload[end] & 0xC0 == 0x80 {
        end -= 1;
    }
    let mut out = payload[..end].to_vec();
    out.extend_from_slice(MARK);
    out.into()
}

/// One whole frame at the front of a buffer.
#[derive(Debug, PartialEq, Eq)]
struct Parsed {
    version: u8,
    kind: u8,
    payload: Vec<u8>,
    /// Bytes of the buffer it took.
    used: usize,
}

/// Parses one frame (of any version: the header is the same in all) from the front of `buf`:
/// `Ok(None)` when more bytes are needed.
fn parse_frame(buf: &[u8]) -> Result<Option<Parsed>, String> {
    let head = buf.len().min(MAGIC.len());
    if buf[..head] != MAGIC[..head] {
        return Err(format!("bad magic {:02x?}", &buf[..head]));
    }
    if buf.len() < HEADER {
        return Ok(None);
    }
    let len = u16::from_be_bytes([buf[6], buf[7]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(format!("a payload of {len} bytes"));
    }
    if buf.len() < HEADER + len {
        return Ok(None);
    }
    Ok(Some(Parsed {
        version: buf[4],
        kind: buf[5],
        payload: buf[HEADER..HEADER + len].to_vec(),
        used: HEADER + len,
    }))
}

/// How many more bytes the frame begun in `buf` needs (its header, then its payload), so that
/// a read takes no byte of the next frame.
fn frame_want(buf: &[u8]) -> usize {
    if buf.len() < HEADER {
        HEADER - buf.len()
    } else {
        (HEADER + u16::from_be_bytes([buf[6], buf[7]]) as usize).saturating_sub(buf.len())
    }
}

/// Reads one whole frame, waiting at most `wait` (or forever with `None`); bytes of a frame not
/// yet complete stay in `buf` for the next call.
fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>, wait: Option<Duration>) -> Frame {
    let deadline = wait.map(|w| Instant::now() + w);
    let mut chunk = [0u8; 256];
    loop {
        match parse_frame(buf) {
            Err(m) => return Frame::Broken(m),
            Ok(Some(f)) => {
                buf.drain(..f.used);
                return if f.version == VERSION {
                    Frame::Msg(f.kind, f.payload)
                } else {
                    Frame::OtherVersion(f.version, f.kind, f.payload)
                };
            }
            Ok(None) => {}
        }
        let left = match deadline {
            None => None,
            Some(d) => match remaining(d) {
                Some(l) => Some(l),
                None => return Frame::TimedOut,
            },
        };
        if let Err(e) = s.set_read_timeout(left) {
            return Frame::Broken(e.to_string());
        }
        // Read no further than the end of this frame, so the next frame stays in the socket.
        let n = frame_want(buf).min(chunk.len());
        match s.read(&mut chunk[..n]) {
            Ok(0) => return Frame::Closed,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Frame::TimedOut
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::BrokenPipe
                ) =>
            {
                return Frame::Closed
            }
            Err(e) => return Frame::Broken(e.to_string()),
        }
    }
}

#[derive(Debug, Default)]
struct LinkState {
    /// The first report of a rank that left the group.
    gone: Mutex<Option<String>>,
    /// Set when this rank closes its links (its readers stop without reporting anything).
    closing: AtomicBool,
}

impl LinkState {
    fn report(&self, m: String) {
        let mut g = self.gone.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(m);
        }
    }
}

type Writer = Arc<Mutex<TcpStream>>;

/// The connections between this rank and the others after the rendezvous, watched by one
/// thread per connection: [`PeerLinks::peer_failure`] says whether a rank left the group.
/// Dropping it says goodbye to the peers and stops the threads.
#[derive(Debug)]
pub struct PeerLinks {
    rank: usize,
    state: Arc<LinkState>,
    writers: Vec<(usize, Writer)>,
    readers: Vec<JoinHandle<()>>,
}

impl PeerLinks {
    fn start(rank: usize, links: Vec<(usize, TcpStream)>) -> Self {
        let state = Arc::new(LinkState::default());
        let mut writers = Vec::new();
        let mut readers_of = Vec::new();
        for (peer, s) in links {
            match s.try_clone() {
                Ok(r) => readers_of.push((peer, r)),
                // Without a reader this link only says goodbye; the collective timeout remains.
                Err(e) => tracing::warn!("rendezvous: cannot watch rank {peer}: {e}"),
            }
            writers.push((peer, Arc::new(Mutex::new(s))));
        }
        let readers = readers_of
            .into_iter()
            .map(|(peer, r)| {
                let state = Arc::clone(&state);
                // Rank 0 forwards a departure to every other rank.
                let others: Vec<(usize, Writer)> = if rank == 0 {
                    writers
                        .iter()
                        .filter(|(p, _)| *p != peer)
                        .map(|(p, w)| (*p, Arc::clone(w)))
                        .collect()
                } else {
                    Vec::new()
                };
                thread::spawn(move || watch(peer, r, &state, &others))
            })
            .collect();
        Self {
            rank,
            state,
            writers,
            readers,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Why the group is broken, if a rank has left it: it said goodbye (dropped its
    /// communicator), its connection closed (the process exited, crashed or was killed), or
    /// rank 0 reported another rank gone.
    pub fn peer_failure(&self) -> Option<String> {
        self.state
            .gone
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// One liveness reader: reports the peer's departure (and, on rank 0, forwards it to `others`).
fn watch(peer: usize, mut s: TcpStream, state: &LinkState, others: &[(usize, Writer)]) {
    let mut buf = Vec::new();
    let gone = loop {
        if state.closing.load(Ordering::Acquire) {
            return;
        }
        let m = match read_frame(&mut s, &mut buf, Some(READER_TICK)) {
            Frame::TimedOut => continue,
            Frame::Msg(GONE, p) if p.len() >= 4 => {
                // Only rank 0 sends these; the message names the rank that left.
                state.report(String::from_utf8_lossy(&p[4..]).into_owned());
                continue;
            }
            Frame::Msg(BYE, _) => format!(
                "rank {peer} left the group (it dropped its communicator: it finished or gave up)"
            ),
            Frame::Msg(kind, _) => format!("rank {peer} sent an unexpected message ({kind})"),
            Frame::Closed => format!(
                "rank {peer}'s connection closed without a goodbye (its process exited, crashed \
                 or was killed)"
            ),
            Frame::OtherVersion(v, kind, _) => {
                format!("rank {peer} sent a message of protocol version {v} (kind {kind})")
            }
            Frame::Broken(m) => format!("the link to rank {peer} broke: {m}"),
        };
        break m;
    };
    if state.closing.load(Ordering::Acquire) {
        return;
    }
    state.report(gone.clone());
    let mut payload = (peer as u32).to_be_bytes().to_vec();
    payload.extend_from_slice(gone.as_bytes());
    for (_, w) in others {
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        let _ = write_frame(&mut w, GONE, &payload);
    }
}

impl Drop for PeerLinks {
    fn drop(&mut self) {
        self.state.closing.store(true, Ordering::Release);
        for (_, w) in &self.writers {
            let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
            let _ = w.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = write_frame(&mut w, BYE, &[]);
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
        // Each reader wakes within READER_TICK and sees `closing`.
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_parse_and_garbage_is_refused() {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&[VERSION, HELLO, 0, 2, 7, 9]);
        let whole = Parsed {
            version: VERSION,
            kind: HELLO,
            payload: vec![7, 9],
            used: 10,
        };
        assert_eq!(parse_frame(&f).unwrap(), Some(whole));
        assert_eq!(parse_frame(&f[..9]).unwrap(), None);
        assert_eq!(frame_want(&f[..9]), 1);
        assert_eq!(parse_frame(b"OO").unwrap(), None);
        assert!(parse_frame(b"GET / HTTP/1.1")
            .unwrap_err()
            .contains("bad magic"));
        // Another version is read whole (to be refused in its own framing).
        let mut v = f.clone();
        v[4] = 1;
        assert_eq!(parse_frame(&v).unwrap().unwrap().version, 1);
        let mut big = f.clone();
        big[6..8].copy_from_slice(&2000u16.to_be_bytes());
        assert!(parse_frame(&big).unwrap_err().contains("2000 bytes"));
    }

    fn cfg(port: u16, rank: usize, world: usize) -> RendezvousConfig {
        RendezvousConfig {
            host: "127.0.0.1".into(),
            port,
            rank,
            world_size: world,
            timeout: Duration::from_secs(20),
            job_id: "unit".into(),
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn connect_to(port: u16) -> TcpStream {
        for _ in 0..500 {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                return s;
            }
            thread::sleep(Duration::from_millis(10));
        }
        panic!("rank 0 never listened on {port}");
    }

    /// Reads what rank 0 sends before it closes the connection (bounded).
    fn reply_of(mut s: TcpStream) -> String {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        assert!(reply.starts_with(b"OOMG\x02\x03"), "a reject: {reply:?}");
        String::from_utf8_lossy(&reply[HEADER..]).into_owned()
    }

    /// Rank 0 with a hello time of 1 s and 4 places for connections without a hello: an idle
    /// connection is refused once its time is up, a flood of 12 drops the oldest at once, and the
    /// real rank still joins.
    #[test]
    fn pending_connections_are_bounded_and_dropped_after_their_hello_time() {
        let port = free_port();
        let limits = Limits {
            hello_wait: Duration::from_secs(1),
            max_pending: 4,
        };
        let server = thread::spawn(move || serve(&cfg(port, 0, 2), [9; ID_BYTES], limits));
        let t0 = Instant::now();
        let m = reply_of(connect_to(port));
        assert!(m.contains("sent no hello within 1.0 s"), "{m}");
        assert!(t0.elapsed() >= Duration::from_secs(1));

        let mut flood: Vec<TcpStream> = (0..12).map(|_| connect_to(port)).collect();
        // dropped for the flood, not after its hello time (that reply would say so): the
        // message tells which, without a clock
        let m = reply_of(flood.remove(0));
        assert!(m.contains("too many connections without a hello"), "{m}");
        let one = join(&cfg(port, 1, 2)).unwrap();
        assert_eq!(one.id, [9; ID_BYTES]);
        assert_eq!(server.join().unwrap().unwrap().id, [9; ID_BYTES]);
        drop(flood);
    }

    /// A rank that joined and gave up before the group was complete (its own, shorter timeout)
    /// is said to have left, not to be missing: rank 0's error named it among the ranks that
    /// never came.
    #[test]
    fn a_rank_that_joined_and_left_is_not_named_missing() {
        let port = free_port();
        let mut c0 = cfg(port, 0, 3);
        c0.timeout = Duration::from_secs(2);
        let server = thread::spawn(move || serve(&c0, [9; ID_BYTES], Limits::DEFAULT));
        let mut c1 = cfg(port, 1, 3);
        c1.timeout = Duration::from_millis(700);
        let e1 = join(&c1).unwrap_err().to_string();
        assert!(e1.contains("rank 0 has 2 of 3 ranks"), "{e1}");
        let e0 = server.join().unwrap().unwrap_err().to_string();
        assert!(e0.contains("missing rank(s) 2;"), "{e0}");
        assert!(e0.contains("rank(s) 1 joined and left"), "{e0}");
    }

    /// A world the rendezvous cannot hold is refused at once (2^32 - 1 ranks aborted the
    /// process allocating a slot per rank), and a long list of missing ranks is named in part.
    #[test]
    fn huge_worlds_are_refused_and_long_lists_are_cut() {
        let mut c = cfg(free_port(), 0, u32::MAX as usize);
        let e = rendezvous(&c, || Ok([0; ID_BYTES]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the rendezvous serves at most"), "{e}");
        c.world_size = 100_000;
        c.timeout = Duration::from_millis(300);
        let e = rendezvous(&c, || Ok([0; ID_BYTES]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing rank(s) 1, 2, 3,"), "{e}");
        assert!(e.contains(" and 99967 more"), "{e}");
        assert!(e.len() < 1_000, "{} bytes", e.len());
    }

    /// A payload longer than a frame is cut at a character boundary and says so.
    #[test]
    fn a_long_payload_is_cut_visibly() {
        let text = "é".repeat(600); // 1,200 bytes
        let cut = fit_payload(text.as_bytes());
        assert!(cut.len() <= MAX_PAYLOAD);
        let cut = std::str::from_utf8(&cut).expect("cut between characters");
        assert!(cut.ends_with("é [cut]"), "{cut}");
        assert_eq!(&*fit_payload(b"short"), b"short");
    }

    /// `localhost` and literal loopback addresses bind loopback; any other name binds every
    /// interface, even one that resolves to loopback on this machine (Debian's own name at
    /// 127.0.1.1: other machines reach it by its real address).
    #[test]
    fn only_a_loopback_address_or_localhost_binds_loopback() {
        let at = |host: &str| {
            let c = RendezvousConfig {
                host: host.into(),
                ..cfg(29_999, 0, 2)
            };
            bind_addr(&c).unwrap()
        };
        assert!(at("127.0.0.1").ip().is_loopback());
        assert!(at("localhost").ip().is_loopback());
        if let Ok(name) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            let name = name.trim();
            let loopback_here = (name, 1u16)
                .to_socket_addrs()
                .is_ok_and(|mut a| a.all(|a| a.ip().is_loopback()));
            if loopback_here && !name.eq_ignore_ascii_case("localhost") {
                assert!(at(name).ip().is_unspecified(), "{name}");
            }
        }
    }
}
