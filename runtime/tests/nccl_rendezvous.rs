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
    }
}

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
    let t0 = Instant::now();
    let (out, made) = group(free_port(), &[4, 4, 4, 4], 10_000);
    assert_eq!(made, 1, "only rank 0 makes the id");
    for (rank, r) in out.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(r.id, id_of(42), "rank {rank}");
        assert_eq!(r.links.rank(), rank);
        assert_eq!(r.links.peer_failure(), None, "rank {rank}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
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
fn world_size_mismatch_fails_on_both_sides() {
    let (out, _) = group(free_port(), &[2, 3], 5_000);
    let m0 = message(&out[0]);
    let m1 = message(&out[1]);
    assert!(
        m0.contains("rank 1") && m0.contains("world size of 3") && m0.contains("with 2"),
        "{m0}"
    );
    assert!(
        m1.contains("ended the rendezvous for rank 1") && m1.contains("world size of 3"),
        "{m1}"
    );
}

#[test]
fn a_rank_out_of_range_or_twice_is_refused() {
    // A peer claiming rank 5 of 2 cannot be built through the API (it checks the rank), so speak
    // the protocol by hand: magic, version 1, kind 1 (hello), length 8, rank, world.
    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 2, 5_000), || Ok(id_of(1))));
    let mut s = loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut hello = b"OOMG\x01\x01\x00\x08".to_vec();
    hello.extend_from_slice(&5u32.to_be_bytes());
    hello.extend_from_slice(&2u32.to_be_bytes());
    s.write_all(&hello).unwrap();
    let m = message(&server.join().unwrap());
    assert!(m.contains("says it is rank 5 of 2"), "{m}");
    // The peer was told why (a reject frame, kind 3, carrying the message).
    let mut reply = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.read_to_end(&mut reply);
    assert!(reply.starts_with(b"OOMG\x01\x03"), "{reply:?}");
    assert!(String::from_utf8_lossy(&reply).contains("rank 5 of 2"));

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
        m1.contains("ended the rendezvous for rank 1") && m1.contains("missing rank(s) 2"),
        "{m1}"
    );

    let port = free_port();
    let server = thread::spawn(move || rendezvous(&cfg(port, 0, 3, 5_000), || Ok(id_of(1))));
    let twice: Vec<_> = (0..2)
        .map(|_| thread::spawn(move || rendezvous(&cfg(port, 1, 3, 5_000), || Ok(id_of(9)))))
        .collect();
    let m = message(&server.join().unwrap());
    assert!(m.contains("rank 1 joined twice"), "{m}");
    for t in twice {
        assert!(t.join().unwrap().is_err());
    }
}

#[test]
fn rank_0_never_coming_is_a_timeout_not_a_hang() {
    let t0 = Instant::now();
    let r = rendezvous(&cfg(free_port(), 1, 2, 600), || panic!("not rank 0"));
    let took = t0.elapsed();
    let m = message(&r);
    assert!(m.contains("rank 0 never answered at 127.0.0.1:"), "{m}");
    assert!(m.contains("OOMGUARD_RENDEZVOUS_PORT"), "{m}");
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(4),
        "{took:?}"
    );
    // Rank 0 alone waiting for rank 1 also ends.
    let t0 = Instant::now();
    let m = message(&rendezvous(&cfg(free_port(), 0, 2, 400), || Ok(id_of(0))));
    assert!(m.contains("1 of 2 ranks joined, missing rank(s) 1"), "{m}");
    assert!(t0.elapsed() < Duration::from_secs(3));
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
    let wrong_version = {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"OOMG\x09\x01\x00\x08\x00\x00\x00\x01\x00\x00\x00\x02")
            .unwrap();
        s
    };
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
    let within = Duration::from_secs(3);
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
    let m = wait_for(|| r0.links.peer_failure(), Duration::from_secs(3))
        .expect("rank 0 hears that rank 1 died");
    assert!(
        m.contains("rank 1's connection closed without a goodbye"),
        "{m}"
    );
}
