//! The NCCL id exchange and liveness links (`nccl::rendezvous`), without NCCL or a GPU: ranks on
//! threads (and one child process) of this machine, on 127.0.0.1 only, each case bounded in time.
#![cfg(feature = "nccl")]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use oomguard_runtime::nccl::{rendezvous, Rendezvous, RendezvousConfig};
use oomguard_runtime::Error;

/// A port nothing listens on right now (the OS's pick, released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cfg(port: u16, rank: usize, world: usize, timeout_ms: u64) -> RendezvousConfig {
    RendezvousConfig {
        host: "127.0.0.1".into(),
        port,
        rank,
        world_size: world,
        timeout: Duration::from_millis(timeout_ms),
        job_id: JOB.into(),
    }
}

/// The job id of the ranks these tests start (a stray of another job uses another).
const JOB: &str = "job-a";

/// Connects to rank 0 once it listens (bounded).
fn connect_to(port: u16) -> TcpStream {
    for _ in 0..500 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return s;
        }
        thread::sleep(Duration::from_millis(10));
    }
    panic!("rank 0 never listened on {port}");
}

/// A hello written by hand: magic, version, kind 1, length, rank, world size, job id (version 2;
/// version 1 had no job id).
fn raw_hello(version: u8, rank: u32, world: u32, job: &str) -> Vec<u8> {
    let mut payload = rank.to_be_bytes().to_vec();
    payload.extend_from_slice(&world.to_be_bytes());
    if version >= 2 {
        payload.extend_from_slice(job.as_bytes());
    }
    let mut f = b"OOMG".to_vec();
    f.extend_from_slice(&[version, 1]);
    f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&payload);
    f
}

/// Reads one frame by hand (bounded): version, kind, payload as text.
fn raw_frame(s: &mut TcpStream) -> (u8, u8, String) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = [0u8; 8];
    s.read_exact(&mut head).expect("a frame header from rank 0");
    assert_eq!(&head[..4], b"OOMG", "{head:?}");
    let mut payload = vec![0u8; u16::from_be_bytes([head[6], head[7]]) as usize];
    s.read_exact(&mut payload).expect("the frame's payload");
    (
        head[4],
        head[5],
        String::from_utf8_lossy(&payload).into_owned(),
    )
}

const WAITING: u8 = 6;
const REJECT: u8 = 3;
const ID: u8 = 2;

fn id_of(seed: u8) -> [u8; 128] {
    std::array::from_fn(|i| seed.wrapping_add(i as u8))
}

/// Runs ranks `0..world` of one group on threads; rank 0 makes the id.
fn group(port: u16, worlds: &[usize], timeout_ms: u64) -> (Vec<Result<Rendezvous, Error>>, usize) {
    let made = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = worlds
        .iter()
        .enumerate()
        .map(|(rank, &world)| {
            let made = Arc::clone(&made);
            thread::spawn(move || {
                rendezvous(&cfg(port, rank, world, timeout_ms), || {
                    made.fetch_add(1, Ordering::SeqCst);
                    Ok(id_of(42))
                })
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (out, made.load(Ordering::SeqCst))
}

fn message(r: &Result<Rendezvous, Error>) -> String {
    let m = r.as_ref().unwrap_err().to_string();
    assert!(!m.contains('\n'), "one line: {m}");
    m
}

/// A hang guard, not a speed goal: far above what a loaded 2-core machine takes (waits poll
/// and return as soon as what they wait for happens).
const HANG: Duration = Duration::from_secs(120);

fn wait_for(mut f: impl FnMut() -> Option<String>, within: Duration) -> Option<String> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Some(m) = f() {
            return Some(m);
        }
        thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn four_ranks_get_rank_0s_id() {
    // (every rank joining proves none waited out its 10 s: no clock here)
    let (out, made) = group(free_port(), &[4, 4, 4, 4], 10_000);
    assert_eq!(made, 1, "only rank 0 makes the id");
    for (rank, r) in out.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(r.id, id_of(42), "rank {rank}");
        assert_eq!(r.links.rank(), rank);
        assert_eq!(r.links.peer_failure(), None, "rank {rank}");
    }
}

#[test]
fn a_rank_started_before_rank_0_keeps_trying() {
    let port = free_port();
    let late = thread::spawn(move || {
        thread::sleep(Duration::from_millis(700));
        rendezvous(&cfg(port, 0, 2, 5_000), || Ok(id_of(7)))
    });
    let r1 = rendezvous(&cfg(port, 1, 2, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(7));
    assert_eq!(late.join().unwrap().unwrap().id, id_of(7));
}

#[test]
fn a_wrong_world_size_is_refused_to_that_rank_only() {
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 10_000), || Ok(id_of(4))));
    let m1 = message(&rendezvous(&cfg(port, 1, 3, 5_000), || {
        panic!("not rank 0")
    }));
    assert!(
        m1.contains("refused rank 1") && m1.contains("world size of 3"),
        "{m1}"
    );
    // Rank 0 goes on: the rank started with the right world size joins.
    let r1 = rendezvous(&cfg(port, 1, 2, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(4));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(4));

    // When the right rank never comes, rank 0's timeout names what it refused.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 1_500), || Ok(id_of(4))));
    let m1 = message(&rendezvous(&cfg(port, 1, 3, 5_000), || {
        panic!("not rank 0")
    }));
    assert!(m1.contains("world size of 3"), "{m1}");
    let m0 = message(&server.join().unwrap());
    assert!(
        m0.contains("missing rank(s) 1")
            && m0.contains("refused 1 peer(s)")
            && m0.contains("world size of 3, rank 0 with 2"),
        "{m0}"
    );
}

#[test]
fn a_rank_out_of_range_or_twice_is_refused_to_that_peer_only() {
    // A peer claiming rank 5 of 2 cannot be built through the API (it checks the rank), so speak
    // the protocol by hand.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 10_000), || Ok(id_of(1))));
    let mut s = connect_to(port);
    s.write_all(&raw_hello(2, 5, 2, JOB)).unwrap();
    // The peer is told why (a reject frame carrying the message) ...
    let (_, kind, m) = raw_frame(&mut s);
    assert_eq!(kind, REJECT, "{m}");
    assert!(m.contains("says it is rank 5 of 2"), "{m}");
    // ... and rank 0 goes on: rank 1 joins.
    let r1 = rendezvous(&cfg(port, 1, 2, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(1));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(1));

    // Rank 2 never comes: rank 0 times out and tells rank 1 why.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 3, 300), || Ok(id_of(1))));
    let m1 = message(&rendezvous(&cfg(port, 1, 3, 5_000), || Ok(id_of(9))));
    let m0 = message(&server.join().unwrap());
    assert!(
        m0.contains("2 of 3 ranks joined, missing rank(s) 2"),
        "{m0}"
    );
    assert!(
        m1.contains("refused rank 1") && m1.contains("missing rank(s) 2"),
        "{m1}"
    );

    // Rank 1 twice: the second is refused, the first keeps its place and gets the id.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 3, 10_000), || Ok(id_of(2))));
    let mut first = connect_to(port);
    first.write_all(&raw_hello(2, 1, 3, JOB)).unwrap();
    assert_eq!(raw_frame(&mut first).1, WAITING);
    let mut second = connect_to(port);
    second.write_all(&raw_hello(2, 1, 3, JOB)).unwrap();
    let (_, kind, m) = raw_frame(&mut second);
    assert_eq!(kind, REJECT, "{m}");
    assert!(m.contains("rank 1 joined twice"), "{m}");
    let r2 = rendezvous(&cfg(port, 2, 3, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r2.id, id_of(2));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(2));
    let (_, kind, _) = raw_frame(&mut first);
    assert_eq!(kind, ID);
}

#[test]
fn a_rank_that_left_before_the_id_can_join_again() {
    // A rank 1 that joins, then dies before the group is complete (a restarted process): its
    // place is freed, and the restarted rank 1 is not "a rank that joined twice".
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 3, 10_000), || Ok(id_of(7))));
    let mut gone = connect_to(port);
    gone.write_all(&raw_hello(2, 1, 3, JOB)).unwrap();
    assert_eq!(raw_frame(&mut gone).1, WAITING);
    drop(gone);
    let ranks: Vec<_> = (1..3)
        .map(|rank| {
            thread::spawn(move || rendezvous(&cfg(port, rank, 3, 10_000), || panic!("not 0")))
        })
        .collect();
    for (rank, r) in ranks.into_iter().enumerate() {
        let r = r.join().unwrap();
        let r = r.unwrap_or_else(|e| panic!("rank {}: {e}", rank + 1));
        assert_eq!(r.id, id_of(7));
    }
    assert_eq!(server.join().unwrap().unwrap().id, id_of(7));
}

#[test]
fn idle_connections_neither_delay_nor_fail_the_real_ranks() {
    // 25 connections that never speak, opened before the ranks: served one at a time with 5 s
    // each, they took 125 s, past this rendezvous's 20 s (and the default 120 s).
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 3, 20_000), || Ok(id_of(6))));
    let idle: Vec<TcpStream> = (0..25).map(|_| connect_to(port)).collect();
    let ranks: Vec<_> = (1..3)
        .map(|rank| {
            thread::spawn(move || rendezvous(&cfg(port, rank, 3, 20_000), || panic!("not 0")))
        })
        .collect();
    for (rank, r) in ranks.into_iter().enumerate() {
        let r = r.join().unwrap();
        let r = r.unwrap_or_else(|e| panic!("rank {}: {e}", rank + 1));
        assert_eq!(r.id, id_of(6));
    }
    assert_eq!(server.join().unwrap().unwrap().id, id_of(6));
    // The ranks did not wait for the idle connections' hello time (5 s): each was still held
    // when the group completed, and is told so.
    for mut s in idle {
        let (_, kind, m) = raw_frame(&mut s);
        assert_eq!(kind, REJECT, "{m}");
        assert!(m.contains("is complete: all 3 ranks joined"), "{m}");
    }
}

#[test]
fn another_jobs_rank_is_refused_and_the_rendezvous_goes_on() {
    // Two jobs on one host with the same port: job B's rank 1 reaches job A's rank 0.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 10_000), || Ok(id_of(8))));
    let mut stray = cfg(port, 1, 2, 5_000);
    stray.job_id = "job-b".into();
    let m = message(&rendezvous(&stray, || panic!("not rank 0")));
    assert!(
        m.contains("job id mismatch")
            && m.contains("serves job \"job-a\"")
            && m.contains("belongs to job \"job-b\""),
        "{m}"
    );
    assert!(m.contains("OOMGUARD_RENDEZVOUS_PORT"), "{m}");
    let r1 = rendezvous(&cfg(port, 1, 2, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(8));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(8));
}

#[test]
fn a_peer_of_the_old_protocol_gets_a_reject_it_can_read() {
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 10_000), || Ok(id_of(3))));
    let mut old = connect_to(port);
    old.write_all(&raw_hello(1, 1, 2, "")).unwrap();
    let (version, kind, m) = raw_frame(&mut old);
    // In version 1's framing, so that an old rank prints the reason.
    assert_eq!((version, kind), (1, REJECT), "{m}");
    assert!(
        m.contains("protocol version 1") && m.contains("version 2") && m.contains("same oomguard"),
        "{m}"
    );
    let r1 = rendezvous(&cfg(port, 1, 2, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(3));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(3));
}

#[test]
fn a_connection_still_waiting_when_rank_0_gives_up_gets_the_reason() {
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 3, 800), || Ok(id_of(0))));
    let mut queued = connect_to(port);
    let m0 = message(&server.join().unwrap());
    assert!(m0.contains("missing rank(s) 1, 2"), "{m0}");
    let (_, kind, m) = raw_frame(&mut queued);
    assert_eq!(kind, REJECT, "{m}");
    assert!(
        m.contains("timed out") && m.contains("missing rank(s) 1, 2"),
        "{m}"
    );
}

#[test]
fn a_silent_service_on_the_port_is_named_as_such() {
    // Accepts, reads, never answers.
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = other.local_addr().unwrap().port();
    let service = thread::spawn(move || {
        let (s, _) = other.accept().unwrap();
        thread::sleep(Duration::from_millis(1_500));
        drop(s);
    });
    let m = message(&rendezvous(&cfg(port, 1, 2, 800), || panic!("not rank 0")));
    assert!(
        m.contains("never answered this rank's hello") && m.contains("not an oomguard rank 0"),
        "{m}"
    );
    assert!(!m.contains("did not all join"), "{m}");
    service.join().unwrap();
}

#[test]
fn a_second_rank_0_is_told_who_holds_the_port() {
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 10_000), || Ok(id_of(5))));
    drop(connect_to(port));
    // Started as rank 0 of the same job: a launcher or RANK mistake.
    let m = message(&rendezvous(&cfg(port, 0, 2, 5_000), || Ok(id_of(6))));
    assert!(m.contains("cannot listen on 127.0.0.1:"), "{m}");
    assert!(m.contains("two processes were started as rank 0"), "{m}");
    // Rank 0 of another job on the same port.
    let mut other = cfg(port, 0, 2, 5_000);
    other.job_id = "job-b".into();
    let m = message(&rendezvous(&other, || Ok(id_of(6))));
    assert!(m.contains("job id mismatch") && m.contains("job-b"), "{m}");
    assert!(m.contains("MASTER_PORT or OOMGUARD_RENDEZVOUS_PORT"), "{m}");
    // Neither probe ended the first rank 0's rendezvous.
    let r1 = rendezvous(&cfg(port, 1, 2, 5_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(5));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(5));
}

#[test]
fn rank_0_never_coming_is_a_timeout_not_a_hang() {
    let t0 = Instant::now();
    let r = rendezvous(&cfg(free_port(), 1, 2, 600), || panic!("not rank 0"));
    let took = t0.elapsed();
    let m = message(&r);
    assert!(m.contains("rank 0 never answered at 127.0.0.1:"), "{m}");
    assert!(m.contains("OOMGUARD_RENDEZVOUS_PORT"), "{m}");
    // at least the timeout; the upper bound only tells "ends" from "hangs" (a loaded
    // machine may be slow)
    assert!(
        took >= Duration::from_millis(600) && took < HANG,
        "{took:?}"
    );
    // Rank 0 alone waiting for rank 1 also ends.
    let t0 = Instant::now();
    let m = message(&rendezvous(&cfg(free_port(), 0, 2, 400), || Ok(id_of(0))));
    assert!(m.contains("1 of 2 ranks joined, missing rank(s) 1"), "{m}");
    assert!(t0.elapsed() < HANG);
}

#[test]
fn garbage_is_refused_on_both_sides() {
    // A "rank 0" that is some other service: rank 1 says so instead of hanging.
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = other.local_addr().unwrap().port();
    let service = thread::spawn(move || {
        let (mut s, _) = other.accept().unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        thread::sleep(Duration::from_millis(300));
    });
    let m = message(&rendezvous(&cfg(port, 1, 2, 5_000), || {
        panic!("not rank 0")
    }));
    assert!(m.contains("does not speak oomguard's rendezvous"), "{m}");
    assert!(m.contains("bad magic"), "{m}");
    service.join().unwrap();

    // Rank 0 drops connections that send garbage, or nothing, and still meets the real rank 1.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 10_000), || Ok(id_of(3))));
    let mut junk = loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        thread::sleep(Duration::from_millis(20));
    };
    junk.write_all(b"\x00\xffgarbage bytes that are not a frame")
        .unwrap();
    let mut wrong_version = TcpStream::connect(("127.0.0.1", port)).unwrap();
    wrong_version
        .write_all(b"OOMG\x09\x01\x00\x08\x00\x00\x00\x01\x00\x00\x00\x02")
        .unwrap();
    let (version, kind, m) = raw_frame(&mut wrong_version);
    assert_eq!((version, kind), (9, REJECT), "{m}");
    assert!(m.contains("protocol version 9"), "{m}");
    let r1 = rendezvous(&cfg(port, 1, 2, 10_000), || panic!("not rank 0")).unwrap();
    assert_eq!(r1.id, id_of(3));
    assert_eq!(server.join().unwrap().unwrap().id, id_of(3));
    drop((junk, wrong_version));
}

#[test]
fn a_rank_that_leaves_is_reported_to_every_rank() {
    let (mut out, _) = group(free_port(), &[3, 3, 3], 10_000);
    let r2 = out.pop().unwrap().unwrap();
    let r1 = out.pop().unwrap().unwrap();
    let r0 = out.pop().unwrap().unwrap();
    assert_eq!(r0.links.peer_failure(), None);
    drop(r2); // rank 2 drops its communicator: it says goodbye
    let within = HANG;
    let m0 = wait_for(|| r0.links.peer_failure(), within).expect("rank 0 hears of rank 2");
    assert!(m0.contains("rank 2 left the group"), "{m0}");
    // Rank 1 is connected to rank 0 only; rank 0 tells it.
    let m1 = wait_for(|| r1.links.peer_failure(), within).expect("rank 1 hears of rank 2");
    assert!(m1.contains("rank 2 left the group"), "{m1}");
    // Rank 0 leaving is seen by rank 1 directly (rank 1 keeps its first report).
    drop(r0);
    assert!(r1.links.peer_failure().unwrap().contains("rank 2"));
}

/// Not a test by itself: the child process of `a_killed_rank_is_reported`, rank 1 of a group of
/// two whose rank 0 listens on `OOMGUARD_TEST_CHILD_PORT`. It joins, then waits to be killed.
#[test]
#[ignore = "run as a child process by a_killed_rank_is_reported"]
fn child_rank_1() {
    let Ok(port) = std::env::var("OOMGUARD_TEST_CHILD_PORT") else {
        return;
    };
    let port: u16 = port.parse().unwrap();
    let r = rendezvous(&cfg(port, 1, 2, 20_000), || panic!("not rank 0")).unwrap();
    println!("joined");
    thread::sleep(Duration::from_secs(30));
    drop(r);
}

#[test]
fn a_killed_rank_is_reported() {
    let port = free_port();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_rank_1", "--nocapture"])
        .env("OOMGUARD_TEST_CHILD_PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let r0 = rendezvous(&cfg(port, 0, 2, 20_000), || Ok(id_of(5)));
    let r0 = match r0 {
        Ok(r) => r,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{e}");
        }
    };
    assert_eq!(r0.links.peer_failure(), None);
    child.kill().unwrap(); // SIGKILL: no goodbye, the kernel closes the socket
    child.wait().unwrap();
    let m = wait_for(|| r0.links.peer_failure(), HANG).expect("rank 0 hears that rank 1 died");
    assert!(
        m.contains("rank 1's connection closed without a goodbye"),
        "{m}"
    );
}
