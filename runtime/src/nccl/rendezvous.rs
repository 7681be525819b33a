//! The NCCL id exchange and the ranks' liveness links, over plain TCP: nothing beyond what the
//! launcher already gives (rank 0's host and a port), no shared filesystem, any number of hosts.
//!
//! Rank 0 listens on `host:port`; every other rank connects (retrying until the deadline while
//! rank 0 is not up yet) and sends a hello (its rank and the world size it was told). When all
//! `world_size - 1` ranks have said hello, rank 0 sends each the 128-byte NCCL unique id. A world
//! size that differs, a rank out of range or a rank that joins twice ends the rendezvous with an
//! error on rank 0 and on the rank concerned; a connection that does not speak this protocol is
//! dropped by rank 0 (a port scanner does not end a rendezvous) and is an error on a rank that
//! gets such an answer.
//!
//! Every message is a frame: `b"OOMG"`, a version byte (1), a kind byte, a big-endian `u16`
//! payload length (at most 1024), the payload.
//!
//! The connections stay open afterwards as liveness links ([`PeerLinks`]): a rank that drops
//! its communicator says goodbye, a rank whose process dies closes its sockets (the kernel does it,
//! even after `kill -9`), and rank 0 tells the other ranks. A collective that waits for a rank
//! reported gone is aborted (see [`super::NcclConsensus`]) instead of waiting for its timeout.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::backend::{BackendError, BackendErrorKind};
use crate::Error;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

const MAGIC: &[u8; 4] = b"OOMG";
const VERSION: u8 = 1;
const HEADER: usize = 8;
const MAX_PAYLOAD: usize = 1024;

const HELLO: u8 = 1;
const ID: u8 = 2;
const REJECT: u8 = 3;
const BYE: u8 = 4;
const GONE: u8 = 5;

/// How long rank 0 waits for a connected peer's hello before dropping the connection.
const HELLO_WAIT: Duration = Duration::from_secs(5);
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
    if cfg.world_size > u32::MAX as usize {
        return Err(err(format!("a world of {} ranks", cfg.world_size)));
    }
    if cfg.timeout.is_zero() {
        return Err(err("the timeout is zero".into()));
    }
    if cfg.rank == 0 {
        let id = make_id()?;
        serve(cfg, id)
    } else {
        join(cfg)
    }
}

/// The address rank 0 binds: the loopback address `host` names when it names one (so a
/// single-host run is not reachable from outside), else every interface of `host`'s family.
fn bind_addr(cfg: &RendezvousConfig) -> Result<SocketAddr, Error> {
    let addrs: Vec<SocketAddr> = (cfg.host.as_str(), cfg.port)
        .to_socket_addrs()
        .map_err(|e| err(format!("cannot resolve rank 0's host {:?}: {e}", cfg.host)))?
        .collect();
    if let Some(a) = addrs.iter().find(|a| a.ip().is_loopback()) {
        return Ok(*a);
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

fn serve(cfg: &RendezvousConfig, id: [u8; ID_BYTES]) -> Result<Rendezvous, Error> {
    let world = cfg.world_size;
    if world == 1 {
        return Ok(Rendezvous {
            id,
            links: PeerLinks::start(0, Vec::new()),
        });
    }
    let addr = bind_addr(cfg)?;
    let listener = TcpListener::bind(addr).map_err(|e| {
        err(format!(
            "rank 0 cannot listen on {addr}: {e} (set OOMGUARD_RENDEZVOUS_PORT to a free port, \
             the same on every rank)"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| err(format!("listen socket: {e}")))?;
    let deadline = Instant::now() + cfg.timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 1;
    while joined < world {
        let Some(left) = remaining(deadline) else {
            let missing: Vec<String> = (1..world)
                .filter(|r| peers[*r].is_none())
                .map(|r| r.to_string())
                .collect();
            let m = format!(
                "timed out after {:.1} s on {addr}: {joined} of {world} ranks joined, missing \
                 rank(s) {}",
                cfg.timeout.as_secs_f64(),
                missing.join(", ")
            );
            for peer in peers.iter_mut().flatten() {
                let _ = write_frame(peer, REJECT, m.as_bytes());
            }
            return Err(err(m));
        };
        let (mut s, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                thread::sleep(left.min(Duration::from_millis(10)));
                continue;
            }
            Err(e) => return Err(err(format!("accept on {addr}: {e}"))),
        };
        let hello = match s.set_nonblocking(false).and_then(|()| s.set_nodelay(true)) {
            Ok(()) => read_frame(&mut s, &mut Vec::new(), Some(left.min(HELLO_WAIT))),
            Err(e) => Frame::Broken(e.to_string()),
        };
        let (rank, their_world) = match hello {
            Frame::Msg(HELLO, p) if p.len() == 8 => (be32(&p[0..4]), be32(&p[4..8])),
            _ => {
                // Not one of ours (or too slow to say so): drop it and keep waiting.
                tracing::warn!("rendezvous: dropped a connection from {from} that sent no hello");
                continue;
            }
        };
        let problem = if their_world != world {
            Some(format!(
                "rank {rank} (from {from}) was started with a world size of {their_world}, rank 0 \
                 with {world}"
            ))
        } else if rank == 0 || rank >= world {
            Some(format!(
                "a peer from {from} says it is rank {rank} of {world}"
            ))
        } else if peers[rank].is_some() {
            Some(format!("rank {rank} joined twice (again from {from})"))
        } else {
            None
        };
        if let Some(p) = problem {
            let _ = write_frame(&mut s, REJECT, p.as_bytes());
            for peer in peers.iter_mut().flatten() {
                let _ = write_frame(peer, REJECT, p.as_bytes());
            }
            return Err(err(p));
        }
        peers[rank] = Some(s);
        joined += 1;
    }
    let mut payload = Vec::with_capacity(4 + ID_BYTES);
    payload.extend_from_slice(&(world as u32).to_be_bytes());
    payload.extend_from_slice(&id);
    let mut links = Vec::with_capacity(world - 1);
    for (rank, s) in peers.into_iter().enumerate() {
        let Some(mut s) = s else { continue };
        write_frame(&mut s, ID, &payload)
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
    let mut last = String::from("no attempt");
    let mut s = loop {
        let Some(left) = remaining(deadline) else {
            return Err(err(format!(
                "timed out after {:.1} s: rank 0 never answered at {at} (last: {last}); is rank 0 \
                 running, and are MASTER_ADDR, MASTER_PORT and OOMGUARD_RENDEZVOUS_PORT the same \
                 on every rank?",
                cfg.timeout.as_secs_f64()
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
    let mut hello = [0u8; 8];
    hello[..4].copy_from_slice(&(cfg.rank as u32).to_be_bytes());
    hello[4..].copy_from_slice(&(cfg.world_size as u32).to_be_bytes());
    write_frame(&mut s, HELLO, &hello)
        .map_err(|e| err(format!("sending hello to rank 0 at {at}: {e}")))?;
    let left = remaining(deadline).unwrap_or(Duration::from_millis(1));
    match read_frame(&mut s, &mut Vec::new(), Some(left)) {
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
        Frame::Msg(REJECT, p) => Err(err(format!(
            "rank 0 at {at} ended the rendezvous for rank {}: {}",
            cfg.rank,
            String::from_utf8_lossy(&p)
        ))),
        Frame::Msg(kind, _) => Err(err(format!(
            "rank 0 at {at} sent an unexpected message (kind {kind})"
        ))),
        Frame::TimedOut => Err(err(format!(
            "timed out after {:.1} s waiting for rank 0 at {at} to send the id (the other ranks \
             did not all join)",
            cfg.timeout.as_secs_f64()
        ))),
        Frame::Closed => Err(err(format!(
            "rank 0 at {at} closed the connection before sending the id"
        ))),
        Frame::Broken(m) => Err(err(format!(
            "{at} does not speak oomguard's rendezvous ({m}): is another service on that port? \
             (set OOMGUARD_RENDEZVOUS_PORT)"
        ))),
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
    /// A frame: kind and payload.
    Msg(u8, Vec<u8>),
    /// Nothing (or not all of it) came in time.
    TimedOut,
    /// The peer closed the connection (or it was reset).
    Closed,
    /// Bytes that are not a frame of this protocol, or a socket error.
    Broken(String),
}

fn write_frame(s: &mut TcpStream, kind: u8, payload: &[u8]) -> io::Result<()> {
    let len = payload.len().min(MAX_PAYLOAD);
    let mut buf = Vec::with_capacity(HEADER + len);
    buf.extend_from_slice(MAGIC);
    buf.push(VERSION);
    buf.push(kind);
    buf.extend_from_slice(&(len as u16).to_be_bytes());
    buf.extend_from_slice(&payload[..len]);
    s.write_all(&buf)
}

/// Parses one frame from the front of `buf`: `Ok(None)` when more bytes are needed.
fn parse_frame(buf: &[u8]) -> Result<Option<(u8, Vec<u8>, usize)>, String> {
    let head = buf.len().min(MAGIC.len());
    if buf[..head] != MAGIC[..head] {
        return Err(format!("bad magic {:02x?}", &buf[..head]));
    }
    if buf.len() < HEADER {
        return Ok(None);
    }
    if buf[4] != VERSION {
        return Err(format!("protocol version {}, expected {VERSION}", buf[4]));
    }
    let len = u16::from_be_bytes([buf[6], buf[7]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(format!("a payload of {len} bytes"));
    }
    if buf.len() < HEADER + len {
        return Ok(None);
    }
    Ok(Some((
        buf[5],
        buf[HEADER..HEADER + len].to_vec(),
        HEADER + len,
    )))
}

/// Reads one whole frame, waiting at most `wait` (or forever with `None`); bytes of a frame not
/// yet complete stay in `buf` for the next call.
fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>, wait: Option<Duration>) -> Frame {
    let deadline = wait.map(|w| Instant::now() + w);
    let mut chunk = [0u8; 256];
    loop {
        match parse_frame(buf) {
            Err(m) => return Frame::Broken(m),
            Ok(Some((kind, payload, used))) => {
                buf.drain(..used);
                return Frame::Msg(kind, payload);
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
        let want = if buf.len() < HEADER {
            HEADER - buf.len()
        } else {
            HEADER + u16::from_be_bytes([buf[6], buf[7]]) as usize - buf.len()
        };
        let n = want.min(chunk.len());
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
        assert_eq!(parse_frame(&f).unwrap(), Some((HELLO, vec![7, 9], 10)));
        assert_eq!(parse_frame(&f[..9]).unwrap(), None);
        assert_eq!(parse_frame(b"OO").unwrap(), None);
        assert!(parse_frame(b"GET / HTTP/1.1")
            .unwrap_err()
            .contains("bad magic"));
        let mut v = f.clone();
        v[4] = 9;
        assert!(parse_frame(&v).unwrap_err().contains("version 9"));
        let mut big = f.clone();
        big[6..8].copy_from_slice(&2000u16.to_be_bytes());
        assert!(parse_frame(&big).unwrap_err().contains("2000 bytes"));
    }
}
