//! The conformance suite every backend runs.
//!
//! A backend's test file implements [`Fixture`] (two fresh, unconnected
//! backends that can reach each other) and expands
//! [`conformance_tests!`](crate::conformance_tests) to get one `#[test]`
//! per case. Each case connects the pair, registers memory on both sides,
//! moves bytes through the [`Backend`] trait alone, and checks the target's
//! memory byte for byte.

use crate::backend::{connect_pair, Backend};
use crate::error::{DataError, SubmitError};
use crate::gpu::GpuDevice;
use crate::ids::{PeerId, RemoteKey, TransferId};
use crate::memory::{Access, Region, RemoteRegion};
use crate::transfer::{
    Completion, Descriptor, Descriptors, Notification, Op, RemoteDescriptor, RemoteDescriptors,
    Transfer,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a case waits for completions before it fails as hung.
pub const CASE_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes backends for the suite.
pub trait Fixture {
    /// The backend under test.
    type Backend: Backend;
    /// Two fresh backends (initiator, target) that can reach each other.
    fn backends(&self) -> (Self::Backend, Self::Backend);
    /// Where the suite's regions live: host memory (`None`, the default)
    /// or this GPU, on both sides.
    fn memory(&self) -> Option<GpuDevice> {
        None
    }
    /// A host region of `len` zeroed bytes for the suite (when
    /// [`memory`](Self::memory) is `None`): [`Region::alloc`] by default,
    /// shareable memory for a backend that serves only that (shm).
    fn host_region(&self, len: usize, access: Access) -> Region {
        Region::alloc(len, access).expect("allocate host region")
    }
}

/// Shm backends for the suite (a queue of 256); every region
/// [`Region::alloc_shared`].
#[cfg(target_os = "linux")]
pub struct ShmFixture;

#[cfg(target_os = "linux")]
impl Fixture for ShmFixture {
    type Backend = crate::shm::ShmBackend;
    fn backends(&self) -> (Self::Backend, Self::Backend) {
        let config = crate::shm::ShmConfig {
            queue_depth: 256,
            ..crate::shm::ShmConfig::default()
        };
        (
            crate::shm::ShmBackend::new(config.clone()).expect("start shm backend"),
            crate::shm::ShmBackend::new(config).expect("start shm backend"),
        )
    }
    fn host_region(&self, len: usize, access: Access) -> Region {
        Region::alloc_shared(len, access).expect("allocate shared region")
    }
}

/// Shm backends for the suite with cross-memory attach on; every region
/// [`Region::alloc`] (memory that is not a file: served by
/// `process_vm_readv`/`process_vm_writev`, here to this same process).
#[cfg(target_os = "linux")]
pub struct ShmAttachFixture;

#[cfg(target_os = "linux")]
impl Fixture for ShmAttachFixture {
    type Backend = crate::shm::ShmBackend;
    fn backends(&self) -> (Self::Backend, Self::Backend) {
        let config = crate::shm::ShmConfig {
            queue_depth: 256,
            cross_memory_attach: true,
            ..crate::shm::ShmConfig::default()
        };
        (
            crate::shm::ShmBackend::new(config.clone()).expect("start shm backend"),
            crate::shm::ShmBackend::new(config).expect("start shm backend"),
        )
    }
}

/// Tcp backends for the suite: a queue of 256 and 64 KiB chunks (so the
/// suite's transfers are split and striped over streams); every region in
/// the memory the function names (`None`: host).
pub struct TcpFixture(pub fn() -> Option<GpuDevice>);

impl Fixture for TcpFixture {
    type Backend = crate::tcp::TcpBackend;
    fn backends(&self) -> (Self::Backend, Self::Backend) {
        let config = crate::tcp::TcpConfig {
            queue_depth: 256,
            chunk_bytes: 64 << 10,
            ..crate::tcp::TcpConfig::default()
        };
        (
            crate::tcp::TcpBackend::new(config.clone()).expect("start tcp backend"),
            crate::tcp::TcpBackend::new(config).expect("start tcp backend"),
        )
    }
    fn memory(&self) -> Option<GpuDevice> {
        (self.0)()
    }
}

/// Loopback backends for the suite (a queue of 256); every region in the
/// memory the function names (`None`: host).
pub struct LoopbackFixture(pub fn() -> Option<GpuDevice>);

impl Fixture for LoopbackFixture {
    type Backend = crate::loopback::LoopbackBackend;
    fn backends(&self) -> (Self::Backend, Self::Backend) {
        let config = crate::loopback::LoopbackConfig {
            queue_depth: 256,
            ..crate::loopback::LoopbackConfig::default()
        };
        (
            crate::loopback::LoopbackBackend::new(config.clone()),
            crate::loopback::LoopbackBackend::new(config),
        )
    }
    fn memory(&self) -> Option<GpuDevice> {
        (self.0)()
    }
}

/// A region of `len` bytes of `memory` (host or GPU), filled with `bytes`
/// (repeated), granting `access`.
pub fn region_in(memory: Option<GpuDevice>, len: usize, access: Access, bytes: &[u8]) -> Region {
    let r = match memory {
        None => Region::alloc(len, access).expect("allocate host region"),
        Some(d) => Region::alloc_device(d, len, access).expect("allocate GPU region"),
    };
    let data: Vec<u8> = bytes.iter().copied().cycle().take(len).collect();
    r.copy_in(0, &data).expect("fill region");
    r
}

/// The whole region's bytes (host or GPU memory).
pub fn contents(r: &Region) -> Vec<u8> {
    let mut out = vec![0u8; r.len() as usize];
    r.copy_out(0, &mut out).expect("read region");
    out
}

/// Deterministic xorshift generator (the suite needs no `rand`).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }
    /// Next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Fills `buf` with pseudo-random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// A connected pair with memory on both sides.
pub struct Setup<B> {
    /// Initiator.
    pub init: B,
    /// Target.
    pub target: B,
    /// The initiator's id for the target.
    pub peer: PeerId,
    /// Initiator memory (random contents), registered with `Access::ALL`.
    pub local: Region,
    /// Target memory (random contents) and what it advertises.
    pub remote: Region,
    /// Advertisement of `remote`.
    pub remote_ad: RemoteRegion,
}

/// Builds a [`Setup`] whose target region grants `remote_access`.
pub fn setup<F: Fixture>(
    f: &F,
    local_len: usize,
    remote_len: usize,
    remote_access: Access,
    seed: u64,
) -> Setup<F::Backend> {
    let (mut init, mut target) = f.backends();
    let mut rng = Rng::new(seed);
    let local = random_region(f, &mut rng, local_len, Access::ALL);
    let remote = random_region(f, &mut rng, remote_len, remote_access);
    let local_ad = init.register(&local).expect("register initiator memory");
    let remote_ad = target.register(&remote).expect("register target memory");
    let (peer, _) =
        connect_pair(&mut init, &[local_ad], &mut target, &[remote_ad]).expect("connect pair");
    Setup {
        init,
        target,
        peer,
        local,
        remote,
        remote_ad,
    }
}

fn random_region<F: Fixture>(f: &F, rng: &mut Rng, len: usize, access: Access) -> Region {
    let mut data = vec![0u8; len];
    rng.fill(&mut data);
    fixture_region(f, len, access, &data)
}

/// A region of `len` bytes of the fixture's memory, filled with `bytes`
/// (repeated), granting `access`.
pub fn fixture_region<F: Fixture>(f: &F, len: usize, access: Access, bytes: &[u8]) -> Region {
    let r = match f.memory() {
        None => f.host_region(len, access),
        Some(d) => Region::alloc_device(d, len, access).expect("allocate GPU region"),
    };
    let data: Vec<u8> = bytes.iter().copied().cycle().take(len).collect();
    r.copy_in(0, &data).expect("fill region");
    r
}

/// Submits every transfer (retrying when the queue is full) and polls both
/// sides until all have completed; panics after [`CASE_TIMEOUT`].
/// Returns completions by id and every notification seen at the target.
pub fn run<B: Backend>(
    init: &mut B,
    target: &mut B,
    transfers: Vec<Transfer>,
) -> (
    HashMap<TransferId, Result<(), DataError>>,
    Vec<Notification>,
) {
    let want = transfers.len();
    let mut results = HashMap::new();
    let mut notes = Vec::new();
    let mut pending = transfers.into_iter();
    let mut retry: Option<Transfer> = None;
    let mut done: Vec<Completion> = Vec::new();
    let end = Instant::now() + CASE_TIMEOUT;
    while results.len() < want {
        // Submit as much as the queue takes.
        while let Some(t) = retry.take().or_else(|| pending.next()) {
            match init.submit(t) {
                Ok(()) => {}
                Err(SubmitError::QueueFull { transfer, .. }) => {
                    retry = Some(*transfer);
                    break;
                }
                Err(SubmitError::Rejected(e)) => panic!("transfer rejected at submit: {e}"),
            }
        }
        poll_pair(init, target, &mut done, &mut results, &mut notes);
        assert!(
            Instant::now() < end,
            "{} of {want} transfers still running",
            want - results.len()
        );
        std::thread::yield_now();
    }
    (results, notes)
}

/// Polls both sides once: the initiator's completions go into `results`
/// (each transfer once), the target's notifications into `notes`.
fn poll_pair<B: Backend>(
    init: &mut B,
    target: &mut B,
    done: &mut Vec<Completion>,
    results: &mut HashMap<TransferId, Result<(), DataError>>,
    notes: &mut Vec<Notification>,
) {
    init.poll(done);
    target.poll(&mut Vec::new());
    target.poll_notifications(notes);
    for c in done.drain(..) {
        assert!(
            results.insert(c.id, c.result).is_none(),
            "{} completed twice",
            c.id
        );
    }
}

/// Runs one transfer and returns its result (submit-time rejection included).
pub fn run_one<B: Backend>(init: &mut B, target: &mut B, t: Transfer) -> Result<(), DataError> {
    let id = t.id;
    if let Err(e) = init.submit(t.clone()) {
        match e {
            SubmitError::Rejected(e) => return Err(e),
            e @ SubmitError::QueueFull { .. } => panic!("submit failed: {e}"),
        }
    }
    let mut done = Vec::new();
    let end = Instant::now() + CASE_TIMEOUT;
    loop {
        init.poll(&mut done);
        target.poll(&mut Vec::new());
        if let Some(i) = done.iter().position(|c| c.id == id) {
            return done.swap_remove(i).result;
        }
        assert!(Instant::now() < end, "{id} hung");
        std::thread::yield_now();
    }
}

/// Polls `b` until every id in `ids` completed, panicking after `limit`;
/// returns each result with the moment it arrived.
pub fn collect(
    b: &mut impl Backend,
    ids: &[TransferId],
    limit: Duration,
) -> HashMap<TransferId, (Result<(), DataError>, Instant)> {
    let end = Instant::now() + limit;
    let mut out = HashMap::new();
    let mut done: Vec<Completion> = Vec::new();
    while out.len() < ids.len() {
        b.poll(&mut done);
        for c in done.drain(..) {
            assert!(
                out.insert(c.id, (c.result, Instant::now())).is_none(),
                "{} completed twice",
                c.id
            );
        }
        assert!(
            Instant::now() < end,
            "{} transfers hang",
            ids.len() - out.len()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    out
}

/// Polls the target until `n` notifications arrived (or the case times out);
/// initiator completions seen meanwhile are appended to `done`.
pub fn wait_notifications<B: Backend>(
    init: &mut B,
    target: &mut B,
    n: usize,
    done: &mut Vec<Completion>,
) -> Vec<Notification> {
    let mut notes = Vec::new();
    let end = Instant::now() + CASE_TIMEOUT;
    while notes.len() < n {
        init.poll(done);
        target.poll(&mut Vec::new());
        target.poll_notifications(&mut notes);
        assert!(
            Instant::now() < end,
            "only {} of {n} notifications arrived",
            notes.len()
        );
        std::thread::yield_now();
    }
    notes
}

/// A transfer of `len` bytes between `local` at `lo` and the remote
/// region `key` at `ro`, with the default deadline.
pub fn one_span(
    peer: PeerId,
    op: Op,
    (local, lo): (&Region, u64),
    (key, ro): (RemoteKey, u64),
    len: u64,
) -> Transfer {
    Transfer::new(
        peer,
        op,
        vec![Descriptor {
            region: local.id(),
            offset: lo,
            len,
        }],
        vec![RemoteDescriptor {
            key,
            offset: ro,
            len,
        }],
    )
}

fn desc(s: &Setup<impl Backend>, lo: u64, ro: u64, len: u64) -> (Descriptor, RemoteDescriptor) {
    (
        Descriptor {
            region: s.local.id(),
            offset: lo,
            len,
        },
        RemoteDescriptor {
            key: s.remote_ad.key,
            offset: ro,
            len,
        },
    )
}

/// A transfer of `(local offset, remote offset, length)` pieces between
/// `s`'s local and remote regions.
pub fn transfer(s: &Setup<impl Backend>, op: Op, pieces: &[(u64, u64, u64)]) -> Transfer {
    let (l, r): (Descriptors, RemoteDescriptors) = pieces
        .iter()
        .map(|&(lo, ro, len)| desc(s, lo, ro, len))
        .unzip();
    Transfer::new(s.peer, op, l, r)
}

/// Random WRITEs then READs, verified byte for byte against a model.
pub fn write_read_roundtrip<F: Fixture>(f: &F) {
    const LEN: u64 = 1 << 20;
    let mut s = setup(f, LEN as usize, LEN as usize, Access::ALL, 1);
    let mut rng = Rng::new(7);
    let mut model = contents(&s.remote);
    let local = contents(&s.local);
    // Non-overlapping remote targets so the outcome is defined.
    let mut transfers = Vec::new();
    let mut cursor = 0u64;
    while cursor + 70_000 < LEN {
        let n = 1 + rng.below(4);
        let mut pieces = Vec::new();
        for _ in 0..n {
            let len = 1 + rng.below(16_384);
            let lo = rng.below(LEN - len);
            pieces.push((lo, cursor, len));
            model[cursor as usize..(cursor + len) as usize]
                .copy_from_slice(&local[lo as usize..(lo + len) as usize]);
            cursor += len + rng.below(64);
        }
        transfers.push(transfer(&s, Op::Write, &pieces));
    }
    let (results, _) = run(&mut s.init, &mut s.target, transfers);
    for (id, r) in &results {
        assert!(r.is_ok(), "{id}: {r:?}");
    }
    assert!(
        contents(&s.remote) == model,
        "target memory differs from the model after WRITE"
    );

    // READ random remote spans into a zeroed local region.
    let back = fixture_region(f, LEN as usize, Access::ALL, &[0]);
    let back_ad = s.init.register(&back).unwrap();
    let _ = back_ad;
    let mut expect = vec![0u8; LEN as usize];
    let mut reads = Vec::new();
    let mut cursor = 0u64;
    while cursor + 70_000 < LEN {
        let len = 1 + rng.below(65_536);
        let ro = rng.below(LEN - len);
        expect[cursor as usize..(cursor + len) as usize]
            .copy_from_slice(&model[ro as usize..(ro + len) as usize]);
        reads.push(Transfer::new(
            s.peer,
            Op::Read,
            vec![Descriptor {
                region: back.id(),
                offset: cursor,
                len,
            }],
            vec![RemoteDescriptor {
                key: s.remote_ad.key,
                offset: ro,
                len,
            }],
        ));
        cursor += len;
    }
    let (results, _) = run(&mut s.init, &mut s.target, reads);
    assert!(
        results.values().all(Result::is_ok),
        "a READ failed: {results:?}"
    );
    assert!(
        contents(&back) == expect,
        "READ results differ from target memory"
    );
}

/// One large transfer each way (exercises splitting and striping).
pub fn large_transfer<F: Fixture>(f: &F) {
    const LEN: u64 = 24 << 20;
    let mut s = setup(f, LEN as usize, LEN as usize, Access::ALL, 2);
    let local = contents(&s.local);
    let t = transfer(&s, Op::Write, &[(0, 0, LEN)]);
    run_one(&mut s.init, &mut s.target, t).expect("large WRITE");
    assert!(contents(&s.remote) == local, "large WRITE corrupted data");
    s.remote.copy_in(0, &vec![0x5a; LEN as usize / 2]).unwrap();
    let t = transfer(&s, Op::Read, &[(0, 0, LEN)]);
    run_one(&mut s.init, &mut s.target, t).expect("large READ");
    assert!(
        contents(&s.local) == contents(&s.remote),
        "large READ corrupted data"
    );
}

/// Hundreds of transfers in flight at once, all verified.
pub fn many_in_flight<F: Fixture>(f: &F) {
    const N: u64 = 512;
    const BLOCK: u64 = 4096;
    let mut s = setup(
        f,
        (N * BLOCK) as usize,
        (N * BLOCK) as usize,
        Access::ALL,
        3,
    );
    let transfers = (0..N)
        .map(|i| transfer(&s, Op::Write, &[(i * BLOCK, (N - 1 - i) * BLOCK, BLOCK)]))
        .collect();
    let (results, _) = run(&mut s.init, &mut s.target, transfers);
    assert_eq!(results.len() as u64, N);
    assert!(results.values().all(Result::is_ok), "{results:?}");
    let (l, r) = (contents(&s.local), contents(&s.remote));
    for i in 0..N as usize {
        let j = N as usize - 1 - i;
        let b = BLOCK as usize;
        assert!(
            l[i * b..(i + 1) * b] == r[j * b..(j + 1) * b],
            "block {i} misplaced"
        );
    }
}

/// A batch submitted in one call: 100 small WRITEs and 100 READs, one
/// refused in the middle (lengths differ), one result each in order; the
/// others all land, byte for byte.
pub fn batch_submission<F: Fixture>(f: &F) {
    const N: u64 = 100;
    const BLOCK: u64 = 4096;
    let mut s = setup(
        f,
        (2 * N * BLOCK) as usize,
        (2 * N * BLOCK) as usize,
        Access::ALL,
        12,
    );
    let bad = N as usize / 2;
    // WRITE local block i to remote block N-1-i; READ remote block N+i
    // into local block N+i.
    let mut transfers: Vec<Transfer> = (0..N)
        .map(|i| transfer(&s, Op::Write, &[(i * BLOCK, (N - 1 - i) * BLOCK, BLOCK)]))
        .chain((0..N).map(|i| {
            let at = (N + i) * BLOCK;
            transfer(&s, Op::Read, &[(at, at, BLOCK)])
        }))
        .collect();
    transfers[bad].remote[0].len = BLOCK - 1;
    let ids: Vec<TransferId> = transfers.iter().map(|t| t.id).collect();
    let mut submitted = Vec::new();
    s.init.submit_batch(transfers, &mut submitted);
    assert_eq!(submitted.len(), ids.len(), "one result per transfer");
    for (i, r) in submitted.iter().enumerate() {
        match r {
            Err(SubmitError::Rejected(DataError::LengthMismatch { .. })) if i == bad => {}
            Ok(()) if i != bad => {}
            other => panic!("transfer {i} of the batch: {other:?}"),
        }
    }
    let want: Vec<TransferId> = ids
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != bad)
        .map(|(_, &id)| id)
        .collect();
    let (mut results, mut notes) = (HashMap::new(), Vec::new());
    let mut done: Vec<Completion> = Vec::new();
    let end = Instant::now() + CASE_TIMEOUT;
    while results.len() < want.len() {
        poll_pair(
            &mut s.init,
            &mut s.target,
            &mut done,
            &mut results,
            &mut notes,
        );
        assert!(
            Instant::now() < end,
            "{} of the batch's transfers hang",
            want.len() - results.len()
        );
        std::thread::yield_now();
    }
    for id in &want {
        assert!(
            matches!(results.get(id), Some(Ok(()))),
            "{id}: {:?}",
            results.get(id)
        );
    }
    assert!(!results.contains_key(&ids[bad]), "the refused transfer ran");
    let (l, r) = (contents(&s.local), contents(&s.remote));
    let b = BLOCK as usize;
    for i in 0..N as usize {
        if i == bad {
            continue;
        }
        let j = N as usize - 1 - i;
        assert!(
            l[i * b..(i + 1) * b] == r[j * b..(j + 1) * b],
            "written block {i} misplaced"
        );
        let k = N as usize + i;
        assert!(
            l[k * b..(k + 1) * b] == r[k * b..(k + 1) * b],
            "read block {k} differs"
        );
    }
}

/// The notification arrives after every byte of its transfer landed.
pub fn notification_after_data<F: Fixture>(f: &F) {
    const LEN: u64 = 4 << 20;
    let mut s = setup(f, LEN as usize, LEN as usize, Access::ALL, 4);
    let pieces: Vec<_> = (0..16)
        .map(|i| (i * (LEN / 16), (15 - i) * (LEN / 16), LEN / 16))
        .collect();
    let t = transfer(&s, Op::Write, &pieces).with_notify(&b"req-42 done"[..]);
    s.init.submit(t).expect("submit");
    let mut done = Vec::new();
    let notes = wait_notifications(&mut s.init, &mut s.target, 1, &mut done);
    // Checked the moment the notification is seen: all data is there.
    let (l, r) = (contents(&s.local), contents(&s.remote));
    for &(lo, ro, len) in &pieces {
        assert!(
            l[lo as usize..(lo + len) as usize] == r[ro as usize..(ro + len) as usize],
            "notification arrived before the bytes at remote offset {ro}"
        );
    }
    assert_eq!(&notes[0].payload[..], b"req-42 done");
    // The initiator's completion still arrives, successful.
    let end = Instant::now() + CASE_TIMEOUT;
    while done.is_empty() {
        s.init.poll(&mut done);
        assert!(
            Instant::now() < end,
            "completion missing after notification"
        );
    }
    assert!(done[0].result.is_ok(), "{:?}", done[0].result);
}

fn assert_untouched(s: &Setup<impl Backend>, local: &[u8], remote: &[u8], what: &str) {
    assert!(
        contents(&s.remote) == remote,
        "{what}: target memory changed"
    );
    assert!(
        contents(&s.local) == local,
        "{what}: initiator memory changed"
    );
}

/// Wrong key, out-of-range and out-of-region requests are refused with the
/// right error, and no byte changes on either side.
pub fn bad_requests_refused<F: Fixture>(f: &F) {
    const LEN: u64 = 64 << 10;
    let mut s = setup(f, LEN as usize, LEN as usize, Access::ALL, 5);
    let (l0, r0) = (contents(&s.local), contents(&s.remote));
    for op in [Op::Write, Op::Read] {
        // A key the target never issued.
        let bad_key = RemoteKey(s.remote_ad.key.0.wrapping_add(0x1000));
        let t = Transfer::new(
            s.peer,
            op,
            vec![Descriptor {
                region: s.local.id(),
                offset: 0,
                len: 128,
            }],
            vec![RemoteDescriptor {
                key: bad_key,
                offset: 0,
                len: 128,
            }],
        );
        let e = run_one(&mut s.init, &mut s.target, t).expect_err("wrong key accepted");
        assert!(
            matches!(e, DataError::UnknownKey { peer, key } if key == bad_key && peer == s.peer),
            "{op} wrong key: {e} (expected UnknownKey naming {bad_key} at {})",
            s.peer
        );
        assert_untouched(&s, &l0, &r0, "wrong key");
        // Past the end of the remote region (the first piece is valid: a
        // refused transfer moves none of its bytes).
        let t = transfer(&s, op, &[(0, 0, 64), (0, LEN - 100, 200)]);
        let e = run_one(&mut s.init, &mut s.target, t).expect_err("out of range accepted");
        assert!(
            matches!(e, DataError::RemoteOutOfBounds { .. }),
            "{op} out of range: {e}"
        );
        assert_untouched(&s, &l0, &r0, "remote out of range");
        // Offset overflow: refused as the remote range it is (named, with
        // the key, offset and length asked for), not as any refusal (a
        // wrapped offset that lands on "unknown key" or a local check
        // would hide the overflow).
        let t = transfer(&s, op, &[(0, u64::MAX - 10, 64)]);
        let e = run_one(&mut s.init, &mut s.target, t).expect_err("overflowing offset accepted");
        let key = s.remote_ad.key;
        assert!(
            matches!(
                e,
                DataError::RemoteOutOfBounds { peer, key: k, offset, len, region_len }
                    if peer == s.peer && k == key && offset == u64::MAX - 10 && len == 64
                        && region_len == LEN
            ),
            "{op} overflow: {e} (expected RemoteOutOfBounds of {key} at {} for {}+64)",
            s.peer,
            u64::MAX - 10
        );
        assert_untouched(&s, &l0, &r0, "offset overflow");
        // Past the end of the local region.
        let t = transfer(&s, op, &[(LEN - 10, 0, 64)]);
        let e = run_one(&mut s.init, &mut s.target, t).expect_err("local out of range accepted");
        assert!(
            matches!(e, DataError::OutOfBounds { .. }),
            "{op} local out of range: {e}"
        );
        assert_untouched(&s, &l0, &r0, "local out of range");
    }
}

/// A region without the remote right is refused for that op only.
pub fn missing_permission_refused<F: Fixture>(f: &F) {
    const LEN: u64 = 64 << 10;
    // Read-only target: WRITE refused, READ allowed.
    let mut s = setup(f, LEN as usize, LEN as usize, Access::REMOTE_READ, 6);
    let (l0, r0) = (contents(&s.local), contents(&s.remote));
    let e = {
        let t = transfer(&s, Op::Write, &[(0, 0, 4096)]);
        run_one(&mut s.init, &mut s.target, t)
    }
    .expect_err("WRITE into a read-only region accepted");
    assert!(
        matches!(e, DataError::AccessDenied { op: Op::Write, .. }),
        "{e}"
    );
    assert_untouched(&s, &l0, &r0, "write to read-only");
    {
        let t = transfer(&s, Op::Read, &[(0, 0, 4096)]);
        run_one(&mut s.init, &mut s.target, t)
    }
    .expect("READ from a read-only region");
    // Write-only target: READ refused.
    let mut s = setup(f, LEN as usize, LEN as usize, Access::REMOTE_WRITE, 7);
    let (l0, r0) = (contents(&s.local), contents(&s.remote));
    let e = {
        let t = transfer(&s, Op::Read, &[(0, 0, 4096)]);
        run_one(&mut s.init, &mut s.target, t)
    }
    .expect_err("READ from a write-only region accepted");
    assert!(
        matches!(e, DataError::AccessDenied { op: Op::Read, .. }),
        "{e}"
    );
    assert_untouched(&s, &l0, &r0, "read from write-only");
}

/// A transfer past its deadline fails as a timeout and moves nothing.
pub fn deadline_expired<F: Fixture>(f: &F) {
    const LEN: u64 = 64 << 10;
    let mut s = setup(f, LEN as usize, LEN as usize, Access::ALL, 8);
    let (l0, r0) = (contents(&s.local), contents(&s.remote));
    let past = Instant::now()
        .checked_sub(Duration::from_millis(5))
        .unwrap_or_else(Instant::now);
    let t = transfer(&s, Op::Write, &[(0, 0, LEN)]).with_deadline(past);
    let e = run_one(&mut s.init, &mut s.target, t).expect_err("expired transfer accepted");
    assert!(e.is_timeout(), "{e}");
    assert_untouched(&s, &l0, &r0, "expired transfer");

    // A deadline still ahead when the transfers are accepted that passes
    // while they wait or move: 32 MiB cannot move in 1 ms, so some of them
    // must fail as timeouts, none before the deadline, and none may hang.
    // Only transfers whose submit returned before the deadline count: one
    // accepted after it was expired on arrival (the case above), and
    // counting it would pass a backend that checks deadlines only at
    // submit. A submit loop too slow to get any transfer in before the
    // deadline (or a backend that moved all of those in time) tries again
    // with a later deadline.
    const BIG: u64 = 32 << 20;
    const PIECE: u64 = 256 << 10;
    let mut tried = Vec::new();
    for ahead_ms in [1, 1, 1, 2, 2, 4, 4, 8] {
        // Fresh backends each try: a timed-out WRITE may cost its
        // connection (tcp drops a stream that was still sending it).
        let mut s = setup(f, BIG as usize, BIG as usize, Access::ALL, 13);
        let deadline = Instant::now() + Duration::from_millis(ahead_ms);
        let mut ids = Vec::new();
        let mut early = std::collections::HashSet::new();
        'submit: for op in [Op::Write, Op::Read] {
            for i in 0..BIG / PIECE / 2 {
                let at = (i * 2 + u64::from(op == Op::Read)) * PIECE;
                let t = transfer(&s, op, &[(at, at, PIECE)]).with_deadline(deadline);
                let id = t.id;
                match s.init.submit(t) {
                    Ok(()) => {
                        if Instant::now() < deadline {
                            early.insert(id);
                        }
                        ids.push(id);
                    }
                    // The queue is shallower than this: enough is in flight.
                    Err(SubmitError::QueueFull { .. }) => break 'submit,
                    Err(e) => panic!("submit: {e}"),
                }
            }
        }
        let results = collect(&mut s.init, &ids, CASE_TIMEOUT);
        let mut early_timeouts = 0;
        for (id, (r, at)) in &results {
            match r {
                Ok(()) => {}
                Err(e) if e.is_timeout() => {
                    assert!(*at >= deadline, "{id} timed out before its deadline");
                    early_timeouts += usize::from(early.contains(id));
                }
                Err(e) => panic!("{id}: {e}"),
            }
        }
        if early_timeouts > 0 {
            return;
        }
        tried.push(format!(
            "{ahead_ms} ms: {} of {} accepted before the deadline",
            early.len(),
            ids.len()
        ));
    }
    panic!(
        "no transfer accepted before its deadline failed as a timeout, though {} MiB \
         cannot move in 1 ms: the deadline was not enforced after submit ({})",
        BIG >> 20,
        tried.join("; ")
    );
}

/// Empty transfers and zero-length descriptors complete successfully, and
/// an empty transfer's notification is still delivered.
pub fn empty_and_zero_length<F: Fixture>(f: &F) {
    let mut s = setup(f, 4096, 4096, Access::ALL, 9);
    let r0 = contents(&s.remote);
    run_one(
        &mut s.init,
        &mut s.target,
        Transfer::new(s.peer, Op::Write, vec![], vec![]),
    )
    .expect("empty transfer");
    let t = transfer(&s, Op::Read, &[(0, 0, 0), (10, 10, 0)]);
    run_one(&mut s.init, &mut s.target, t).expect("zero-length descriptors");
    let t = Transfer::new(s.peer, Op::Write, vec![], vec![]).with_notify(&b"empty"[..]);
    run_one(&mut s.init, &mut s.target, t).expect("empty transfer with notification");
    let notes = wait_notifications(&mut s.init, &mut s.target, 1, &mut Vec::new());
    assert_eq!(&notes[0].payload[..], b"empty");
    assert!(contents(&s.remote) == r0);
}

/// Lists of different total length are rejected at submit.
pub fn length_mismatch_rejected<F: Fixture>(f: &F) {
    let mut s = setup(f, 4096, 4096, Access::ALL, 10);
    let t = Transfer::new(
        s.peer,
        Op::Write,
        vec![Descriptor {
            region: s.local.id(),
            offset: 0,
            len: 100,
        }],
        vec![RemoteDescriptor {
            key: s.remote_ad.key,
            offset: 0,
            len: 99,
        }],
    );
    match s.init.submit(t) {
        Err(SubmitError::Rejected(DataError::LengthMismatch {
            local: 100,
            remote: 99,
        })) => {}
        other => panic!("expected a length mismatch rejection, got {other:?}"),
    }
}

/// Submitting without polling eventually fills the queue; the transfer is
/// handed back intact, and everything submitted still completes.
pub fn queue_full_hands_back<F: Fixture>(f: &F) {
    let mut s = setup(f, 4096, 4096, Access::ALL, 11);
    let mut accepted = Vec::new();
    let mut handed_back = None;
    for i in 0..(1u64 << 17) {
        let t = transfer(&s, Op::Write, &[(i % 4000, i % 4000, 8)]);
        let id = t.id;
        match s.init.submit(t) {
            Ok(()) => accepted.push(id),
            Err(SubmitError::QueueFull { transfer, .. }) => {
                assert_eq!(transfer.id, id, "a different transfer was handed back");
                assert_eq!(
                    transfer.local[0].len, 8,
                    "the handed-back transfer was altered"
                );
                assert!(SubmitError::QueueFull {
                    transfer: transfer.clone(),
                    in_flight: 0
                }
                .is_retryable());
                handed_back = Some(*transfer);
                break;
            }
            Err(e) => panic!("unexpected submit error: {e}"),
        }
    }
    let mut retry =
        Some(handed_back.expect("the queue never filled: backends must bound their queues"));
    let want = accepted.len() + 1;
    // Drain: the handed-back transfer goes in once there is room, and every
    // transfer completes exactly once.
    let mut done = Vec::new();
    let end = Instant::now() + CASE_TIMEOUT;
    let mut seen = std::collections::HashSet::new();
    while seen.len() < want {
        s.init.poll(&mut done);
        s.target.poll(&mut Vec::new());
        for c in done.drain(..) {
            assert!(c.result.is_ok(), "{}: {:?}", c.id, c.result);
            assert!(seen.insert(c.id), "{} completed twice", c.id);
        }
        if let Some(t) = retry.take() {
            match s.init.submit(t) {
                Ok(()) => {}
                Err(SubmitError::QueueFull { transfer, .. }) => retry = Some(*transfer),
                Err(e) => panic!("resubmit failed: {e}"),
            }
        }
        assert!(
            Instant::now() < end,
            "{} transfers never completed",
            want - seen.len()
        );
        std::thread::yield_now();
    }
}

/// Deregistering the target's region while WRITEs into it are in flight
/// (32 x 1 MiB): once `deregister` returns the backend neither writes nor
/// reads the region's memory (the application may free it), so a pattern
/// written there afterwards survives every transfer; and every transfer
/// completes, done or refused (unknown key, region revoked) or with its
/// connection lost, never hanging. Not in
/// [`conformance_tests!`](crate::conformance_tests): run by
/// the tcp and loopback tests.
pub fn deregister_stops_target_access<F: Fixture>(f: &F) {
    const PIECE: u64 = 1 << 20;
    const N: u64 = 32;
    let mut s = setup(
        f,
        (N * PIECE) as usize,
        (N * PIECE) as usize,
        Access::ALL,
        13,
    );
    let mut ids = Vec::new();
    for i in 0..N {
        let t = transfer(&s, Op::Write, &[(i * PIECE, i * PIECE, PIECE)]);
        ids.push(t.id);
        s.init.submit(t).expect("submit");
    }
    let mut done = Vec::new();
    let mut results = HashMap::new();
    // Some of it moves (a loopback poll copies up to its budget).
    s.init.poll(&mut done);
    s.target.deregister(s.remote.id()).expect("deregister");
    // What an application does with memory it got back.
    let pattern = vec![0x5a; (N * PIECE) as usize];
    s.remote.copy_in(0, &pattern).expect("fill");
    let end = Instant::now() + CASE_TIMEOUT;
    while results.len() < ids.len() {
        s.init.poll(&mut done);
        s.target.poll(&mut Vec::new());
        for c in done.drain(..) {
            assert!(results.insert(c.id, c.result).is_none(), "{} twice", c.id);
        }
        assert!(
            Instant::now() < end,
            "transfers hang after a deregistration"
        );
        std::thread::yield_now();
    }
    for (id, r) in &results {
        assert!(
            r.is_ok()
                || r.as_ref()
                    .is_err_and(|e| e.is_refused() || e.is_peer_lost()),
            "{id}: {r:?}"
        );
    }
    // Late bytes would have landed by now.
    std::thread::sleep(Duration::from_millis(50));
    s.init.poll(&mut done);
    let after = contents(&s.remote);
    let changed = after.iter().zip(&pattern).filter(|(a, b)| a != b).count();
    assert_eq!(
        changed, 0,
        "{changed} bytes of a deregistered region changed after deregister returned"
    );
}

/// Removing a peer fails its in-flight transfers (or they had finished);
/// none is lost and none hangs, and with 64 MiB in flight at least one
/// did not finish and fails as `PeerLost`.
pub fn removed_peer_fails_in_flight<F: Fixture>(f: &F) {
    // 64 x 1 MiB: more than a loaded host moves over loopback while the
    // 64 submissions and the removal run (16 MiB was not, for two rails).
    const PIECE: u64 = 1 << 20;
    let mut s = setup(f, 64 << 20, 64 << 20, Access::ALL, 12);
    let mut ids = Vec::new();
    for i in 0..64u64 {
        let t = transfer(&s, Op::Write, &[(i * PIECE, i * PIECE, PIECE)]);
        ids.push(t.id);
        s.init.submit(t).expect("submit");
    }
    s.init.remove_peer(s.peer);
    let mut done = Vec::new();
    let end = Instant::now() + CASE_TIMEOUT;
    let mut results = HashMap::new();
    while results.len() < ids.len() {
        s.init.poll(&mut done);
        for c in done.drain(..) {
            assert!(results.insert(c.id, c.result).is_none());
        }
        assert!(Instant::now() < end, "transfers of a removed peer hang");
        std::thread::yield_now();
    }
    let mut lost = 0;
    for (id, r) in results {
        assert!(
            r.as_ref().is_ok() || r.as_ref().is_err_and(DataError::is_peer_lost),
            "{id}: {r:?}"
        );
        lost += usize::from(r.is_err());
    }
    assert!(
        lost > 0,
        "all 64 transfers (64 MiB) finished before remove_peer returned: nothing was in flight"
    );
    let after = transfer(&s, Op::Write, &[(0, 0, 8)]);
    match s.init.submit(after) {
        Err(SubmitError::Rejected(DataError::UnknownPeer(p))) => assert_eq!(p, s.peer),
        Ok(()) => {
            let mut done = Vec::new();
            while done.is_empty() {
                s.init.poll(&mut done);
                assert!(Instant::now() < end, "transfer to a removed peer hangs");
            }
            assert!(
                done[0].result.is_err(),
                "a removed peer accepted a transfer"
            );
        }
        Err(e) => panic!("unexpected: {e}"),
    }
}

/// Expands to one `#[test]` per conformance case for a [`Fixture`]
/// expression.
#[macro_export]
macro_rules! conformance_tests {
    (#[ignore = $reason:literal] $fixture:expr) => {
        $crate::conformance_tests!(@ignored $reason; $fixture;
            write_read_roundtrip, large_transfer, many_in_flight, notification_after_data,
            bad_requests_refused, missing_permission_refused, deadline_expired,
            empty_and_zero_length, length_mismatch_rejected, queue_full_hands_back,
            removed_peer_fails_in_flight, batch_submission);
    };
    (@ignored $reason:literal; $fixture:expr; $($case:ident),*) => {
        $(
            #[test]
            #[ignore = $reason]
            fn $case() {
                $crate::conformance::$case(&$fixture);
            }
        )*
    };
    ($fixture:expr) => {
        $crate::conformance_tests!(@cases $fixture;
            write_read_roundtrip, large_transfer, many_in_flight, notification_after_data,
            bad_requests_refused, missing_permission_refused, deadline_expired,
            empty_and_zero_length, length_mismatch_rejected, queue_full_hands_back,
            removed_peer_fails_in_flight, batch_submission);
    };
    (@cases $fixture:expr; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::$case(&$fixture);
            }
        )*
    };
}

/// Allocating on `missing`, a device the runtime does not have (it has
/// `count`), is `Unsupported` with `NoDevice`, and the message names the
/// device and the count.
pub fn missing_device_is_unsupported(missing: GpuDevice, count: u32) {
    use crate::gpu::{GpuError, GpuUnavailable};
    let err = Region::alloc_device(missing, 4096, Access::ALL).unwrap_err();
    match &err {
        DataError::Gpu(GpuError::Unsupported {
            device,
            why: GpuUnavailable::NoDevice { count: c },
        }) => assert_eq!((*device, *c), (missing, count)),
        e => panic!("unexpected: {e:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&missing.to_string()) && msg.contains(&format!("{count} device")),
        "{msg}"
    );
}

/// Host memory to `device` memory and back over tcp (6 MiB and an odd
/// tail, several staging chunks): a WRITE whose notification arrives only
/// once every byte is in the target's device memory, then a READ into
/// zeroed host memory; both byte-checked. Panics on any difference.
pub fn host_and_device_over_tcp(device: GpuDevice) {
    use crate::tcp::{TcpBackend, TcpConfig};
    let len = (6 << 20) + 17;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
    let host = Region::from_vec(data.clone(), Access::ALL).expect("host region");
    let gpu = region_in(Some(device), len, Access::ALL, &[0]);
    let mut init = TcpBackend::new(TcpConfig::default()).expect("start tcp backend");
    let mut target = TcpBackend::new(TcpConfig::default()).expect("start tcp backend");
    let host_ad = init.register(&host).expect("register host memory");
    let gpu_ad = target.register(&gpu).expect("register device memory");
    let (peer, _) = connect_pair(&mut init, &[host_ad], &mut target, &[gpu_ad]).expect("connect");
    let desc = |op| {
        Transfer::new(
            peer,
            op,
            vec![Descriptor {
                region: host.id(),
                offset: 0,
                len: len as u64,
            }],
            vec![RemoteDescriptor {
                key: gpu_ad.key,
                offset: 0,
                len: len as u64,
            }],
        )
    };
    init.submit(desc(Op::Write).with_notify(b"landed".to_vec()))
        .expect("submit the WRITE");
    let notes = wait_notifications(&mut init, &mut target, 1, &mut Vec::new());
    assert_eq!(&notes[0].payload[..], b"landed");
    // The notification came after every byte reached device memory.
    assert!(
        contents(&gpu) == data,
        "{device} memory differs after the WRITE"
    );
    host.copy_in(0, &vec![0; len]).expect("zero host memory");
    run_one(&mut init, &mut target, desc(Op::Read)).expect("READ from the device");
    assert!(
        contents(&host) == data,
        "host memory differs after the READ"
    );
}

/// The mock CUDA driver's C source (`testdata/mock_cuda.c`): the driver
/// functions kvlane calls, implemented on host memory. Not a GPU.
pub const MOCK_CUDA_SOURCE: &str = include_str!("../testdata/mock_cuda.c");

/// Compiles the mock CUDA driver with `cc` into `dir`; returns the path of
/// the shared library (`dir/libcuda.so.1`).
pub fn build_mock_cuda(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    build_mock(dir, "CUDA driver", MOCK_CUDA_SOURCE, "libcuda.so.1", &[])
}

/// The mock CUDA driver without its IPC functions (`cuIpcGetMemHandle`,
/// `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`,
/// `cuMemGetAddressRange_v2`), as a driver that lacks them; compiled with
/// `cc` into `dir`, returns the library's path.
pub fn build_mock_cuda_without_ipc(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    build_mock(
        dir,
        "CUDA driver",
        MOCK_CUDA_SOURCE,
        "libcuda.so.1",
        &["-DMOCK_CUDA_NO_IPC".to_owned()],
    )
}

/// What both mocks include (`testdata/mock_gpu.h`): the allocation table
/// and asynchronous copies that run only when their stream is synchronized.
const MOCK_GPU_HEADER: &str = include_str!("../testdata/mock_gpu.h");

/// Compiles `source` (with `mock_gpu.h` beside it, and `defines`,
/// `-DNAME=VALUE`) with `cc` into `dir/lib`; its path.
fn build_mock(
    dir: &std::path::Path,
    what: &str,
    source: &str,
    lib: &str,
    defines: &[String],
) -> std::io::Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("mock_gpu.h"), MOCK_GPU_HEADER)?;
    let src = dir.join(format!("{lib}.c"));
    let lib = dir.join(lib);
    std::fs::write(&src, source)?;
    let out = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-O2", "-Wall"])
        .args(defines)
        .arg("-o")
        .arg(&lib)
        .arg(&src)
        .arg("-lpthread")
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "cc failed to build the mock {what}: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(lib)
}

/// The mock HIP runtime's C source (`testdata/mock_hip.c`): the HIP
/// functions kvlane calls, implemented on host memory. Not a GPU.
pub const MOCK_HIP_SOURCE: &str = include_str!("../testdata/mock_hip.c");

/// Compiles the mock HIP runtime with `cc` into `dir`, reporting `version`
/// (`HIP_VERSION` encoding: 60200000 is ROCm 6.2; before 60000000 it
/// answers pointer attributes in ROCm 5's encoding, before 60200000 it has
/// no dma-buf export, as the real runtimes); returns the path of the
/// shared library (`dir/libamdhip64.so`).
pub fn build_mock_hip(dir: &std::path::Path, version: u32) -> std::io::Result<std::path::PathBuf> {
    let define = format!("-DMOCK_HIP_VERSION={version}");
    build_mock(
        dir,
        "HIP runtime",
        MOCK_HIP_SOURCE,
        "libamdhip64.so",
        &[define],
    )
}

/// Builds the mock HIP runtime once per process (two devices, reporting
/// `version`, see [`build_mock_hip`]) and points the loader at it
/// (`KVLANE_HIP_LIBRARY`); returns `rocm:0`. Call it before anything in the
/// process touches a ROCm device: the runtime is loaded once, so every
/// call in a process must pass the same `version`. For tests on machines
/// without a GPU; nothing it moves touches one.
pub fn use_mock_hip(version: u32) -> GpuDevice {
    static LIB: std::sync::OnceLock<(u32, std::path::PathBuf)> = std::sync::OnceLock::new();
    let (built, _) = LIB.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("kvlane-mock-hip-{}-{version}", std::process::id()));
        let lib = build_mock_hip(&dir, version).expect("build the mock HIP runtime (needs cc)");
        // Set once, before any thread of this process loads a GPU runtime.
        std::env::set_var("KVLANE_HIP_LIBRARY", &lib);
        std::env::set_var("KVLANE_MOCK_HIP_DEVICES", "2");
        (version, lib)
    });
    assert_eq!(
        *built, version,
        "the mock HIP runtime of this process reports {built}"
    );
    GpuDevice::rocm(0)
}

/// Builds the mock CUDA driver once per process (two devices) and points
/// the loader at it (`KVLANE_CUDA_LIBRARY`); returns `cuda:0`. Call it
/// before anything in the process touches a GPU: the driver is loaded
/// once. For tests on machines without a GPU; nothing it moves touches one.
pub fn use_mock_cuda() -> GpuDevice {
    static LIB: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvlane-mock-cuda-{}", std::process::id()));
        let lib = build_mock_cuda(&dir).expect("build the mock CUDA driver (needs cc)");
        // Set once, before any thread of this process loads a GPU driver.
        std::env::set_var("KVLANE_CUDA_LIBRARY", &lib);
        std::env::set_var("KVLANE_MOCK_CUDA_DEVICES", "2");
        lib
    });
    GpuDevice::cuda(0)
}
