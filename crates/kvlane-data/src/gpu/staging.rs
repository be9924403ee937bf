//! Moving device memory with the CPU: chunked, double-buffered copies
//! through pinned host buffers, each half on its own stream.
//!
//! The backends that move bytes themselves (tcp, loopback) reach region
//! memory through [`Region::read_chunks`] and [`Region::write_chunks`]. For
//! host memory these hand over the region's bytes in one slice, exactly as
//! `with_slice{,_mut}` do; for GPU memory they hand over pinned chunks:
//!
//! - `read_chunks`: the device-to-host copy of chunk k+1 runs while the
//!   caller consumes chunk k (writes it to a socket).
//! - `write_chunks`: the host-to-device copy of chunk k runs while the
//!   caller fills chunk k+1 (reads it from a socket); the call returns only
//!   after every byte is in device memory, so a completion or notification
//!   sent after it is never early.

use super::device::DeviceMemory;
use super::{GpuDevice, GpuError, Stream};
use crate::error::DataError;
use crate::memory::{MemoryKind, Region};
use std::convert::Infallible;
use std::sync::Arc;

/// Bytes of one staging buffer, the largest chunk. Not measured yet on a
/// GPU: large enough that a copy's launch cost (~10 µs) is small beside its
/// transfer (~80 µs at 25 GB/s).
pub(crate) const CHUNK: usize = 2 << 20;

/// The smallest chunk a range is split into (see [`chunk_len`]).
const MIN_CHUNK: u64 = 128 << 10;

/// Chunk length for a range of `len` bytes: a quarter of it, within
/// `MIN_CHUNK..=CHUNK`. The tcp backend moves at most `chunk_bytes`
/// (512 KiB by default) per request, so a request's copy is cut in four
/// and only about a quarter of it is not overlapped with the socket (the
/// first chunk on the way out, the last on the way in). Not measured yet
/// on a GPU.
fn chunk_len(len: u64) -> u64 {
    (len / 4)
        .next_multiple_of(4096)
        .clamp(MIN_CHUNK, CHUNK as u64)
}

struct Half {
    stream: Stream,
    buf: *mut u8,
}

/// Two pinned buffers of [`CHUNK`] bytes, each with its stream.
pub(crate) struct Stager {
    driver: Arc<dyn super::Driver>,
    device: GpuDevice,
    halves: Vec<Half>,
}

// SAFETY: the buffers are pinned host memory owned by the stager and only
// touched by whoever holds it (the pool hands it to one caller at a time);
// stream handles may be used from any thread once their device is bound.
unsafe impl Send for Stager {}

impl Stager {
    /// Allocates a pair on the device bound on this thread.
    pub(crate) fn new(driver: Arc<dyn super::Driver>, device: GpuDevice) -> Result<Self, GpuError> {
        let mut s = Self {
            driver,
            device,
            halves: Vec::with_capacity(2),
        };
        for _ in 0..2 {
            let stream = s.driver.stream_create().map_err(|e| e.on(device))?;
            let buf = match s.driver.host_alloc(CHUNK) {
                Ok(b) => b,
                Err(e) => {
                    // SAFETY: created just above, destroyed once.
                    unsafe { s.driver.stream_destroy(stream) };
                    return Err(e.on(device));
                }
            };
            s.halves.push(Half { stream, buf });
        }
        Ok(s)
    }

    fn sync(&self, i: usize) -> Result<(), GpuError> {
        self.driver
            .stream_sync(self.halves[i].stream)
            .map_err(|e| e.on(self.device))
    }

    fn sync_all(&self) -> Result<(), GpuError> {
        (0..self.halves.len()).try_for_each(|i| self.sync(i))
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        if self.driver.bind(self.device.ordinal).is_err() {
            return;
        }
        let _ = self.sync_all();
        for h in self.halves.drain(..) {
            // SAFETY: both were made by `new` and are released once; the
            // streams were synchronized, so no copy uses the buffers.
            unsafe {
                self.driver.host_free(h.buf);
                self.driver.stream_destroy(h.stream);
            }
        }
    }
}

/// A stager lent from its device's pool; synchronized and returned on drop
/// (dropped instead if a stream failed).
struct Lent<'a> {
    mem: &'a DeviceMemory,
    st: Option<Stager>,
}

impl<'a> Lent<'a> {
    fn new(mem: &'a DeviceMemory) -> Result<Self, GpuError> {
        Ok(Self {
            mem,
            st: Some(mem.context().stager()?),
        })
    }

    fn st(&self) -> &Stager {
        self.st.as_ref().expect("present until drop")
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if let Some(st) = self.st.take() {
            if st.sync_all().is_ok() {
                self.mem.context().give_back(st);
            }
        }
    }
}

/// `(position, length)` of each chunk of `len` bytes.
fn chunks(len: u64) -> impl Iterator<Item = (u64, usize)> {
    let step = chunk_len(len);
    (0..len.div_ceil(step)).map(move |k| {
        let pos = k * step;
        (pos, (len - pos).min(step) as usize)
    })
}

impl DeviceMemory {
    /// See [`Region::read_chunks`]; `offset..offset+len` is in bounds.
    fn read_chunks<E>(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, GpuError> {
        let lent = Lent::new(self)?;
        let st = lent.st();
        let d = self.context().driver();
        let base = self.addr() + offset;
        let issue = |k: usize, (pos, n): (u64, usize)| {
            // `f` may have bound another device on this thread (a copy
            // between two devices' memory stages into the other one).
            self.context().bind()?;
            let h = &st.halves[k % 2];
            // SAFETY: `base+pos..+n` is inside the registered device range
            // (the caller checked the bounds); `h.buf` holds CHUNK >= n
            // pinned bytes that nothing reads until this stream is
            // synchronized (below, or in `Lent::drop`).
            unsafe { d.dtoh_async(h.buf, base + pos, n, h.stream) }.map_err(|e| e.on(self.device()))
        };
        let all: Vec<_> = chunks(len).collect();
        if let Some(first) = all.first() {
            issue(0, *first)?;
        }
        for (k, &(_, n)) in all.iter().enumerate() {
            if let Some(next) = all.get(k + 1) {
                issue(k + 1, *next)?;
            }
            st.sync(k % 2)?;
            let h = &st.halves[k % 2];
            // SAFETY: the copy into this half completed (synchronized just
            // above) and the next copy into it is issued only after `f`
            // returns; `n <= CHUNK` bytes are initialized.
            let chunk = unsafe { std::slice::from_raw_parts(h.buf, n) };
            if let Err(e) = f(chunk) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// See [`Region::write_chunks`]; `offset..offset+len` is in bounds.
    fn write_chunks<E>(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, GpuError> {
        let lent = Lent::new(self)?;
        let st = lent.st();
        let d = self.context().driver();
        let base = self.addr() + offset;
        for (k, (pos, n)) in chunks(len).enumerate() {
            if k >= 2 {
                // The copy out of this half two chunks ago must be done.
                st.sync(k % 2)?;
            }
            let h = &st.halves[k % 2];
            // SAFETY: this half's stream is idle (synchronized above, or
            // never used in this call; a lent stager is always quiet), so
            // nothing else reads or writes its CHUNK >= n pinned bytes.
            let chunk = unsafe { std::slice::from_raw_parts_mut(h.buf, n) };
            if let Err(e) = f(chunk) {
                return Ok(Err(e));
            }
            // As in `read_chunks`: `f` may have bound another device.
            self.context().bind()?;
            // SAFETY: the device range is in bounds (checked by the caller);
            // the buffer is not touched again before its stream is
            // synchronized.
            unsafe { d.htod_async(base + pos, h.buf, n, h.stream) }
                .map_err(|e| e.on(self.device()))?;
        }
        // Completion semantics: every byte is in device memory on return.
        st.sync_all()?;
        Ok(Ok(()))
    }
}

impl DeviceMemory {
    /// Copies `len` bytes from `src` at `src_offset` to this memory at
    /// `offset` with one device-to-device copy on this device's stream;
    /// returns once it is done. Both ranges are in bounds and on the same
    /// device.
    fn copy_from_device(
        &self,
        offset: u64,
        src: &Self,
        src_offset: u64,
        len: u64,
    ) -> Result<(), GpuError> {
        let lent = Lent::new(self)?;
        let st = lent.st();
        let d = self.context().driver();
        let h = &st.halves[0];
        // SAFETY: both ranges are device memory of this (bound) device,
        // in bounds (checked by the caller); the copy is synchronized
        // below (or by `Lent::drop` when issuing fails) before either
        // region can be released. In bounds of an allocation: fits usize.
        unsafe {
            d.dtod_async(
                self.addr() + offset,
                src.addr() + src_offset,
                len as usize,
                h.stream,
            )
        }
        .map_err(|e| e.on(self.device()))?;
        st.sync(0)
    }
}

impl Region {
    /// The device memory behind a GPU region; `None` for host memory.
    fn staged(&self) -> Result<Option<&Arc<DeviceMemory>>, DataError> {
        match self.kind() {
            MemoryKind::Host => Ok(None),
            MemoryKind::Gpu { .. } => self.gpu().map(Some).ok_or(DataError::Unsupported {
                backend: "staging",
                what: "GPU memory registered with Region::from_raw has no runtime handle; use Region::from_device_ptr",
            }),
            MemoryKind::Device { .. } => Err(DataError::Unsupported {
                backend: "staging",
                what: "dma-buf memory without its GPU runtime can only be served by verbs; register it with Region::from_device_ptr to stage it",
            }),
        }
    }

    /// Hands the bytes `offset..offset+len` to `f`: GPU memory in pinned
    /// chunks staged ahead of `f`; host memory copied once into a buffer
    /// (the safe API lends no slice of region memory: backends move host
    /// memory with `recv_from`/`send_vectored` and call this for GPU
    /// regions).
    /// Stops at the first error of `f` and returns it inside `Ok`.
    pub fn read_chunks<E>(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, DataError> {
        let Some(mem) = self.staged()? else {
            self.check_range(offset, len)?;
            // In range of an allocated region: fits usize.
            let mut tmp = vec![0u8; len as usize];
            self.read(offset, &mut tmp)?;
            return Ok(f(&tmp));
        };
        self.check_range(offset, len)?;
        Ok(mem.read_chunks(offset, len, &mut f)?)
    }

    /// Lets `f` fill the bytes `offset..offset+len`: GPU memory in pinned
    /// chunks copied to the device while `f` fills the next; host memory
    /// through one buffer copied in after `f` (see `read_chunks`). Returns once every byte `f` filled is in
    /// the region's memory. Stops at the first error of `f` (the range's
    /// contents are then unspecified).
    pub fn write_chunks<E>(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, DataError> {
        let Some(mem) = self.staged()? else {
            self.check_range(offset, len)?;
            let mut tmp = vec![0u8; len as usize];
            if let Err(e) = f(&mut tmp) {
                return Ok(Err(e));
            }
            self.write(offset, &tmp)?;
            return Ok(Ok(()));
        };
        self.check_range(offset, len)?;
        Ok(mem.write_chunks(offset, len, &mut f)?)
    }

    /// Copies `src` into the region at `offset`; host or GPU memory.
    pub fn copy_in(&self, offset: u64, src: &[u8]) -> Result<(), DataError> {
        if self.staged()?.is_none() {
            return self.write(offset, src);
        }
        let mut rest = src;
        let r = self.write_chunks(offset, src.len() as u64, |chunk| {
            let (now, later) = rest.split_at(chunk.len());
            chunk.copy_from_slice(now);
            rest = later;
            Ok::<_, Infallible>(())
        })?;
        let Ok(()) = r;
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the region; host or GPU
    /// memory.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), DataError> {
        if self.staged()?.is_none() {
            return self.read(offset, dst);
        }
        let mut rest = dst;
        let r = self.read_chunks(offset, rest.len() as u64, |chunk| {
            let (now, later) = std::mem::take(&mut rest).split_at_mut(chunk.len());
            now.copy_from_slice(chunk);
            rest = later;
            Ok::<_, Infallible>(())
        })?;
        let Ok(()) = r;
        Ok(())
    }
}

/// Copies `len` bytes between two regions of any memory kinds (loopback,
/// shm): host to host by `memcpy`, between two regions of one device by
/// one device-to-device copy, otherwise staged through pinned buffers.
/// Both ranges are checked first; nothing moves when either is bad.
/// Returns once every byte is in `dst`.
pub(crate) fn copy_between(
    src: &Region,
    src_offset: u64,
    dst: &Region,
    dst_offset: u64,
    len: u64,
) -> Result<(), DataError> {
    let (s, d) = (src.staged()?, dst.staged()?);
    if s.is_none() && d.is_none() {
        return src.copy_to(src_offset, dst, dst_offset, len);
    }
    src.check_range(src_offset, len)?;
    dst.check_range(dst_offset, len)?;
    // Both on one device: one copy by the device, no staging.
    if let (Some(s), Some(d)) = (s, d) {
        if s.device() == d.device() {
            if len > 0 {
                d.copy_from_device(dst_offset, s, src_offset, len)?;
            }
            return Ok(());
        }
    }
    let mut at = dst_offset;
    src.read_chunks(src_offset, len, |chunk| {
        dst.copy_in(at, chunk)?;
        at += chunk.len() as u64;
        Ok::<_, DataError>(())
    })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_exactly() {
        assert_eq!(chunks(0).count(), 0);
        assert_eq!(chunks(1).collect::<Vec<_>>(), [(0, 1)]);
        // A tcp request (512 KiB) in four.
        let q = 128 << 10;
        let c: Vec<_> = chunks(512 << 10).collect();
        assert_eq!(
            c,
            [(0, q), (q as u64, q), (2 * q as u64, q), (3 * q as u64, q)]
        );
        // Large ranges in buffer-sized chunks, the last one short.
        let c: Vec<_> = chunks(8 * CHUNK as u64 + 5).collect();
        assert_eq!(c.len(), 9);
        assert!(c[..8].iter().all(|&(_, n)| n == CHUNK));
        assert_eq!(c[8], (8 * CHUNK as u64, 5));
        for len in [1u64, 4095, 4097, 600_000, 3 << 20, (5 << 20) + 3] {
            let c: Vec<_> = chunks(len).collect();
            assert_eq!(c.iter().map(|&(_, n)| n as u64).sum::<u64>(), len);
            assert!(c.windows(2).all(|w| w[0].0 + w[0].1 as u64 == w[1].0));
            assert!(c.iter().all(|&(_, n)| n <= CHUNK));
        }
    }

    #[test]
    fn host_regions_come_in_one_slice() {
        let r = Region::from_vec((0..=255u8).collect(), crate::Access::ALL).unwrap();
        let mut calls = 0;
        r.read_chunks(10, 200, |s| {
            calls += 1;
            assert_eq!((s.len(), s[0]), (200, 10));
            Ok::<_, ()>(())
        })
        .unwrap()
        .unwrap();
        r.write_chunks(0, 3, |s| {
            calls += 1;
            s.copy_from_slice(&[9, 9, 9]);
            Ok::<_, ()>(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(calls, 2);
        assert_eq!(&r.to_vec().unwrap()[..4], &[9, 9, 9, 3]);
        assert!(matches!(
            r.read_chunks(250, 10, |_| Ok::<_, ()>(())),
            Err(DataError::OutOfBounds { .. })
        ));
    }
}
