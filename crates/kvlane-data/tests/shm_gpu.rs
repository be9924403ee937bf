//! GPU memory served by the shm backend through CUDA / HIP IPC handles,
//! across two processes, against the mock CUDA driver and the mock HIP
//! runtime (testdata/: "device" memory is host memory in memfds, IPC
//! handles open them through /proc). Nothing here runs on a GPU.
//!
//! The target is this test binary run again as `gpu_target` (which does
//! nothing unless `KVLANE_SHM_GPU_CHILD` names a runtime). It serves two
//! regions of device memory: a slice in the middle of a larger allocation
//! on device 0 (so the IPC handle maps more than the region) and a
//! read-only allocation of its own on device 1.
#![cfg(target_os = "linux")]

use kvlane_data::conformance::{collect, one_span, use_mock_cuda, use_mock_hip};
use kvlane_data::{
    Access, Backend, DataError, Endpoint, GpuDevice, GpuRuntime, Op, PeerId, Region, RemoteRegion,
    ShmBackend, ShmConfig, TransferId,
};
use std::ffi::c_int;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of each served region: more than one staging chunk (2 MiB), not
/// a multiple of a page.
const LEN: usize = (3 << 20) + 1000;
/// Bytes of the allocation on each side of the slice served from device 0.
const GUARD: usize = 1 << 20;
/// The HIP version the mock runtime reports (ROCm 6.2).
const HIP: u32 = 60_200_000;

/// The tests of this binary count IPC mappings of the whole process: one
/// at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// Which GPUs a test runs on: a mock runtime (two devices), or a real
/// device (`KVLANE_TEST_GPU`, for the ignored test), which then holds both
/// of the target's regions.
#[derive(Clone, Copy, Debug)]
enum Gpus {
    Mock(GpuRuntime),
    Real(GpuDevice),
}

impl Gpus {
    /// Device `ordinal` (a mock has two; a real run uses its one device),
    /// after pointing the loader at the mock.
    fn device(self, ordinal: u32) -> GpuDevice {
        match self {
            Self::Mock(GpuRuntime::Cuda) => GpuDevice {
                ordinal,
                ..use_mock_cuda()
            },
            Self::Mock(GpuRuntime::Rocm) => GpuDevice {
                ordinal,
                ..use_mock_hip(HIP)
            },
            Self::Real(d) => d,
        }
    }

    /// How the target process is told (`KVLANE_SHM_GPU_CHILD`).
    fn to_env(self) -> String {
        match self {
            Self::Mock(r) => format!("mock-{r}"),
            Self::Real(d) => d.to_string(),
        }
    }

    fn from_env(s: &str) -> Self {
        match s {
            "mock-cuda" => Self::Mock(GpuRuntime::Cuda),
            "mock-rocm" => Self::Mock(GpuRuntime::Rocm),
            d => Self::Real(d.parse().expect("a GPU device")),
        }
    }

    /// IPC mappings open in this process (`kvlane_mock_ipc_open_count` of
    /// the mock); `None` on a real GPU.
    fn ipc_open_count(self) -> Option<i32> {
        let var = match self {
            Self::Mock(GpuRuntime::Cuda) => "KVLANE_CUDA_LIBRARY",
            Self::Mock(GpuRuntime::Rocm) => "KVLANE_HIP_LIBRARY",
            Self::Real(_) => return None,
        };
        self.device(0);
        let path = std::env::var_os(var).expect("mock loaded first");
        // SAFETY: the mock this process already loaded (one more
        // reference); its initializers have no preconditions.
        let lib = unsafe { libloading::Library::new(&path) }.expect("load the mock");
        // SAFETY: the symbol is `int kvlane_mock_ipc_open_count(void)`.
        Some(unsafe {
            let f: libloading::Symbol<unsafe extern "C" fn() -> c_int> = lib
                .get(b"kvlane_mock_ipc_open_count\0")
                .expect("the mock exports kvlane_mock_ipc_open_count");
            f()
        })
    }
}

/// The target process: serves a slice of a larger allocation on device 0
/// (filled with `pattern(1)`, the rest of the allocation with 0xEE) and a
/// read-only allocation on device 1 (`pattern(2)`). Prints the hex of
/// `(Endpoint, [RemoteRegion; 2])`, then answers commands from stdin:
/// `sum0` / `sum1` (FNV-1a of a region), `guard` (FNV-1a of the bytes of
/// device 0's allocation outside the slice), `notes` (notifications so
/// far), `dereg1` (deregisters the second region).
#[test]
#[ignore = "the target process of the tests in this file; does nothing unless KVLANE_SHM_GPU_CHILD is set"]
fn gpu_target() {
    let Ok(gpus) = std::env::var("KVLANE_SHM_GPU_CHILD") else {
        return;
    };
    let gpus = Gpus::from_env(&gpus);
    let (dev0, dev1) = (gpus.device(0), gpus.device(1));
    let mut b = ShmBackend::new(ShmConfig::default()).unwrap();
    let whole = Region::alloc_device(dev0, GUARD + LEN + GUARD, Access::ALL).unwrap();
    whole.copy_in(0, &vec![0xEE; GUARD + LEN + GUARD]).unwrap();
    // SAFETY: a range inside `whole`, which the region keeps alive.
    let slice = unsafe {
        Region::from_device_ptr(
            dev0,
            whole.addr() + GUARD as u64,
            LEN,
            Access::ALL,
            Some(Box::new(whole.clone())),
        )
    }
    .unwrap();
    slice.copy_in(0, &pattern(1, LEN)).unwrap();
    let read_only = Region::alloc_device(dev1, LEN, Access::REMOTE_READ).unwrap();
    read_only.copy_in(0, &pattern(2, LEN)).unwrap();
    let ads = vec![b.register(&slice).unwrap(), b.register(&read_only).unwrap()];
    let (_, ep) = b.prepare_peer().unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "ENDPOINT {}",
        hex(&rmp_serde::to_vec_named(&(ep, ads)).unwrap())
    )
    .unwrap();
    out.flush().unwrap();
    let sum = |r: &Region, off: usize, len: usize| {
        let mut buf = vec![0u8; len];
        r.copy_out(off as u64, &mut buf).unwrap();
        buf
    };
    let mut notes = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        b.poll_notifications(&mut notes);
        match line.trim() {
            "sum0" => writeln!(out, "SUM {:016x}", fnv1a(&sum(&slice, 0, LEN))),
            "sum1" => writeln!(out, "SUM {:016x}", fnv1a(&sum(&read_only, 0, LEN))),
            "guard" => {
                let mut g = sum(&whole, 0, GUARD);
                g.extend(sum(&whole, GUARD + LEN, GUARD));
                writeln!(out, "GUARD {}", g.iter().all(|&x| x == 0xEE))
            }
            "notes" => writeln!(out, "NOTES {}", notes.len()),
            "dereg1" => {
                b.deregister(read_only.id()).unwrap();
                writeln!(out, "DEREG")
            }
            other => writeln!(out, "unknown command {other:?}"),
        }
        .unwrap();
        out.flush().unwrap();
    }
}

struct Target {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    endpoint: Endpoint,
    regions: Vec<RemoteRegion>,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Target {
    fn spawn(gpus: Gpus) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "gpu_target", "--ignored", "--nocapture"])
            .args(["--test-threads=1"])
            .env("KVLANE_SHM_GPU_CHILD", gpus.to_env())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut t = Self {
            child,
            stdin,
            lines,
            endpoint: Endpoint {
                backend: kvlane_data::BackendKind::Shm,
                data: Vec::new(),
            },
            regions: Vec::new(),
        };
        let blob = unhex(&t.expect("ENDPOINT "));
        (t.endpoint, t.regions) = rmp_serde::from_slice(&blob).expect("decode endpoint");
        t
    }

    /// The rest of the next line that contains `prefix`.
    fn expect(&self, prefix: &str) -> String {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("the target printed no {prefix:?}: {e}"));
            if let Some((_, rest)) = line.split_once(prefix) {
                return rest.to_owned();
            }
        }
    }

    fn command(&mut self, cmd: &str, answer: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.expect(answer)
    }
}

/// An initiator with a host region (`pattern(7)`) and a region on its own
/// device 0 (`pattern(9)`), connected to `t`.
fn initiator(gpus: Gpus, t: &Target) -> (ShmBackend, PeerId, Region, Region) {
    let dev = gpus.device(0);
    let mut b = ShmBackend::new(ShmConfig::default()).unwrap();
    let host = Region::alloc(LEN, Access::LOCAL_WRITE).unwrap();
    host.write(0, &pattern(7, LEN)).unwrap();
    let gpu = Region::alloc_device(dev, LEN, Access::LOCAL_WRITE).unwrap();
    gpu.copy_in(0, &pattern(9, LEN)).unwrap();
    b.register(&host).unwrap();
    b.register(&gpu).unwrap();
    let (peer, _) = b.prepare_peer().unwrap();
    b.connect_peer(peer, &t.endpoint, &t.regions).unwrap();
    (b, peer, host, gpu)
}

/// Submits `x` and waits for its result.
fn run(b: &mut ShmBackend, x: kvlane_data::Transfer) -> Result<(), DataError> {
    let id = x.id;
    b.submit(x).unwrap();
    collect(b, &[id], Duration::from_secs(30))
        .remove(&id)
        .unwrap()
        .0
}

fn run_all(b: &mut ShmBackend, ids: &[TransferId]) {
    for (id, (r, _)) in collect(b, ids, Duration::from_secs(60)) {
        assert!(r.is_ok(), "{id}: {r:?}");
    }
}

fn contents(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; LEN];
    r.copy_out(0, &mut v).unwrap();
    v
}

/// READ and WRITE of the target's device memory from host memory and from
/// this side's device memory; notifications after the data; nothing
/// outside the served slice touched; the read-only region refuses WRITE;
/// revocation and drop close the IPC mappings.
fn roundtrip(gpus: Gpus) {
    let mut t = Target::spawn(gpus);
    let before = gpus.ipc_open_count();
    let open = |n: i32| before.map(|b| b + n);
    let (mut b, peer, host, gpu) = initiator(gpus, &t);
    assert_eq!(gpus.ipc_open_count(), open(2), "one mapping per region");
    let (key0, key1) = (t.regions[0].key, t.regions[1].key);
    let half = (LEN / 2) as u64;

    // READ into host memory, in two transfers; then into device memory.
    let back = Region::alloc(LEN, Access::LOCAL_WRITE).unwrap();
    b.register(&back).unwrap();
    let xs = [
        one_span(peer, Op::Read, (&back, 0), (key0, 0), half),
        one_span(
            peer,
            Op::Read,
            (&back, half),
            (key0, half),
            LEN as u64 - half,
        ),
    ];
    let ids: Vec<_> = xs.iter().map(|x| x.id).collect();
    for x in xs {
        b.submit(x).unwrap();
    }
    run_all(&mut b, &ids);
    assert!(back.to_vec().unwrap() == pattern(1, LEN), "READ into host");
    run(
        &mut b,
        one_span(peer, Op::Read, (&gpu, 0), (key1, 0), LEN as u64),
    )
    .unwrap();
    assert!(contents(&gpu) == pattern(2, LEN), "READ into device");

    // WRITE from host memory, notified: the data is there when the target
    // has the notification.
    let x =
        one_span(peer, Op::Write, (&host, 0), (key0, 0), LEN as u64).with_notify(&b"from host"[..]);
    run(&mut b, x).unwrap();
    assert_eq!(t.command("notes", "NOTES "), "1");
    assert_eq!(
        t.command("sum0", "SUM "),
        format!("{:016x}", fnv1a(&pattern(7, LEN))),
        "WRITE from host"
    );
    // WRITE from device memory (odd offsets and lengths), notified.
    gpu.copy_in(0, &pattern(9, LEN)).unwrap();
    let x = one_span(peer, Op::Write, (&gpu, 3), (key0, 3), LEN as u64 - 5)
        .with_notify(&b"from device"[..]);
    run(&mut b, x).unwrap();
    assert_eq!(t.command("notes", "NOTES "), "2");
    let mut want = pattern(9, LEN);
    want[..3].copy_from_slice(&pattern(7, LEN)[..3]);
    want[LEN - 2..].copy_from_slice(&pattern(7, LEN)[LEN - 2..]);
    assert_eq!(
        t.command("sum0", "SUM "),
        format!("{:016x}", fnv1a(&want)),
        "WRITE from device"
    );
    assert_eq!(
        t.command("guard", "GUARD "),
        "true",
        "bytes outside the slice"
    );

    // The read-only region refuses WRITE, from either memory.
    for local in [&host, &gpu] {
        let err = run(&mut b, one_span(peer, Op::Write, (local, 0), (key1, 0), 64)).unwrap_err();
        assert!(matches!(err, DataError::AccessDenied { .. }), "{err}");
    }
    assert_eq!(
        t.command("sum1", "SUM "),
        format!("{:016x}", fnv1a(&pattern(2, LEN)))
    );

    // Revocation closes that region's mapping; the other keeps working.
    assert_eq!(t.command("dereg1", "DEREG"), "");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = run(&mut b, one_span(peer, Op::Read, (&host, 0), (key1, 0), 64));
        if matches!(r, Err(DataError::UnknownKey { .. })) {
            break;
        }
        assert!(Instant::now() < deadline, "never revoked: {r:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(gpus.ipc_open_count(), open(1), "revoked mapping closed");
    run(
        &mut b,
        one_span(peer, Op::Read, (&back, 0), (key0, 0), 4096),
    )
    .unwrap();
    drop(b);
    assert_eq!(gpus.ipc_open_count(), open(0), "mappings closed on drop");
}

#[test]
fn cuda_device_memory_moves_both_ways_across_processes() {
    let _g = serial();
    roundtrip(Gpus::Mock(GpuRuntime::Cuda));
}

#[test]
fn hip_device_memory_moves_both_ways_across_processes() {
    let _g = serial();
    roundtrip(Gpus::Mock(GpuRuntime::Rocm));
}

/// The roundtrip on a real GPU: `KVLANE_TEST_GPU=cuda:0 cargo test -p
/// kvlane-data --test shm_gpu -- --ignored real_gpu`. Fails loudly
/// without the variable or without the device.
#[test]
#[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:N or rocm:N"]
fn real_gpu_device_memory_moves_both_ways_across_processes() {
    let _g = serial();
    let dev: GpuDevice = std::env::var("KVLANE_TEST_GPU")
        .expect("KVLANE_TEST_GPU names no device: set it to cuda:N or rocm:N")
        .parse()
        .expect("KVLANE_TEST_GPU is cuda:N or rocm:N");
    let found = kvlane_data::gpu_devices(dev.runtime).expect("the GPU driver works");
    assert!(
        found.iter().any(|i| i.device == dev),
        "{dev} is not among {found:?}"
    );
    roundtrip(Gpus::Real(dev));
}

#[test]
fn wrong_keys_and_out_of_range_offsets_are_refused_and_move_nothing() {
    let _g = serial();
    let rt = Gpus::Mock(GpuRuntime::Cuda);
    let mut t = Target::spawn(rt);
    let (mut b, peer, host, gpu) = initiator(rt, &t);
    let key = t.regions[0].key;
    let len = LEN as u64;
    type Expect = fn(&DataError) -> bool;
    let cases: Vec<(kvlane_data::Transfer, Expect)> = vec![
        // A key the target never granted.
        (
            one_span(
                peer,
                Op::Write,
                (&host, 0),
                (kvlane_data::RemoteKey(key.0 ^ 0x5a5a), 0),
                16,
            ),
            |e| matches!(e, DataError::UnknownKey { .. }),
        ),
        // Past the end, straddling it, an offset whose end wraps: the
        // allocation goes on past the region (GUARD bytes), the grant not.
        (one_span(peer, Op::Write, (&host, 0), (key, len), 1), |e| {
            matches!(e, DataError::RemoteOutOfBounds { .. })
        }),
        (
            one_span(peer, Op::Write, (&gpu, 0), (key, len - 100), 200),
            |e| matches!(e, DataError::RemoteOutOfBounds { .. }),
        ),
        (
            one_span(peer, Op::Read, (&gpu, 0), (key, u64::MAX - 10), 20),
            |e| matches!(e, DataError::RemoteOutOfBounds { .. }),
        ),
        // A READ past the end of the local device region.
        (
            one_span(peer, Op::Read, (&gpu, len - 8), (key, 0), 16),
            |e| matches!(e, DataError::OutOfBounds { .. }),
        ),
    ];
    for (i, (x, want)) in cases.into_iter().enumerate() {
        let err = run(&mut b, x).unwrap_err();
        assert!(want(&err), "case {i}: {err}");
        assert!(err.is_refused(), "case {i}: {err}");
    }
    assert_eq!(
        t.command("sum0", "SUM "),
        format!("{:016x}", fnv1a(&pattern(1, LEN))),
        "target memory changed"
    );
    assert_eq!(t.command("guard", "GUARD "), "true");
    assert!(contents(&gpu) == pattern(9, LEN), "local memory changed");
}

/// Waits until every thread of process `pid` is stopped.
fn wait_stopped(pid: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    let stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .all(|task| {
                let stat =
                    std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
            })
    };
    while !stopped() {
        assert!(Instant::now() < until, "the target never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_killed_target_fails_in_flight_transfers_with_peer_lost() {
    let _g = serial();
    let rt = Gpus::Mock(GpuRuntime::Cuda);
    let t = Target::spawn(rt);
    let (mut b, peer, host, gpu) = initiator(rt, &t);
    let key = t.regions[0].key;
    run(&mut b, one_span(peer, Op::Write, (&gpu, 0), (key, 0), 4096)).unwrap();
    // A stopped target answers no notification: these WRITEs are copied
    // (its memory is still mapped here) and stay in flight.
    let pid = t.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    wait_stopped(&pid);
    let mut doomed = Vec::new();
    for k in 0..4u64 {
        let local = if k % 2 == 0 { &host } else { &gpu };
        let x = one_span(peer, Op::Write, (local, k * 4096), (key, k * 4096), 4096)
            .with_notify(&b"n"[..]);
        doomed.push(x.id);
        b.submit(x).unwrap();
    }
    let mut done = Vec::new();
    let settle = Instant::now() + Duration::from_millis(200);
    while Instant::now() < settle {
        b.poll(&mut done);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        done.is_empty(),
        "completed without an answer: {}",
        done.len()
    );
    assert!(Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap()
        .success());
    for (id, (r, _)) in collect(&mut b, &doomed, Duration::from_secs(10)) {
        assert!(
            r.as_ref().is_err_and(DataError::is_peer_lost),
            "{id}: {r:?}"
        );
    }
    let r = run(&mut b, one_span(peer, Op::Read, (&gpu, 0), (key, 0), 64));
    assert!(r.as_ref().is_err_and(DataError::is_peer_lost), "{r:?}");
}

/// Run as a child process by `a_driver_without_ipc_refuses_to_serve_gpu_memory`:
/// its CUDA driver is the mock built without the IPC functions.
#[test]
#[ignore = "run by a_driver_without_ipc_refuses_to_serve_gpu_memory; does nothing unless KVLANE_SHM_GPU_NO_IPC_CHILD is set"]
fn no_ipc_child() {
    let Some(dir) = std::env::var_os("KVLANE_SHM_GPU_NO_IPC_CHILD") else {
        return;
    };
    let lib = kvlane_data::conformance::build_mock_cuda_without_ipc(dir.as_ref()).unwrap();
    std::env::set_var("KVLANE_CUDA_LIBRARY", lib);
    let mut b = ShmBackend::new(ShmConfig::default()).unwrap();
    let r = Region::alloc_device(GpuDevice::cuda(0), 4096, Access::ALL).unwrap();
    let err = b.register(&r).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, DataError::Gpu(g) if g.is_unsupported()),
        "{err:?}"
    );
    assert!(msg.contains("lacks cuMemGetAddressRange_v2"), "{msg}");
    // Memory without remote rights is still local memory of transfers.
    let local = Region::alloc_device(GpuDevice::cuda(0), 4096, Access::LOCAL_WRITE).unwrap();
    b.register(&local).unwrap();
    println!("NO-IPC-OK {msg}");
}

#[test]
fn a_driver_without_ipc_refuses_to_serve_gpu_memory() {
    let dir = std::env::temp_dir().join(format!("kvlane-mock-cuda-noipc-{}", std::process::id()));
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "no_ipc_child", "--ignored", "--nocapture"])
        .env("KVLANE_SHM_GPU_NO_IPC_CHILD", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("NO-IPC-OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}
