//! The buffer protocol, declared here because the limited API of the
//! oldest Python this module supports (3.9) does not include it. The
//! functions and the `Py_buffer` layout have been exported unchanged by
//! every CPython 3 and are part of the stable ABI since 3.11 (PEP 688's
//! prerequisites, bpo-45459), so an abi3 module may call them.

use crate::errors::invalid;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_char, c_int, c_void, CStr};

#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

const PYBUF_SIMPLE: c_int = 0;
const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

/// An acquired buffer of a Python object: the exporter keeps the memory
/// in place (a `bytearray` cannot resize, an `mmap` cannot close) until the
/// view is dropped, which releases it with the GIL held.
pub(crate) struct BufferView {
    raw: Box<RawBuffer>,
}

// SAFETY: the view is plain data (pointers the exporter keeps valid until
// release); its memory is accessed by kvlane only through the region's
// bounds-checked copies, and the view itself is touched again only in
// `drop`, which takes the GIL before calling into Python.
unsafe impl Send for BufferView {}
// SAFETY: as above; `&BufferView` exposes only reads of plain fields.
unsafe impl Sync for BufferView {}

impl BufferView {
    /// Acquires `obj`'s buffer: C-contiguous, writable when `writable`.
    pub(crate) fn acquire(obj: &Bound<'_, PyAny>, writable: bool, shaped: bool) -> PyResult<Self> {
        let mut raw = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        let mut flags = if shaped {
            PYBUF_FORMAT | PYBUF_C_CONTIGUOUS
        } else {
            PYBUF_SIMPLE
        };
        if writable {
            flags |= PYBUF_WRITABLE;
        }
        // SAFETY: `obj` is a live object (we hold the GIL through `Bound`),
        // `raw` points to a writable `Py_buffer`-shaped struct that stays at
        // one address (boxed) until `PyBuffer_Release` in `drop`.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Self { raw })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.raw.buf.cast()
    }

    pub(crate) fn len(&self) -> usize {
        self.raw.len as usize
    }

    pub(crate) fn readonly(&self) -> bool {
        self.raw.readonly != 0
    }

    /// The buffer as `u64` rows of `cols` (2 or 3) columns; `None` when it
    /// is not a buffer of 8-byte integers shaped `(n, 2|3)` or `(2n,)`.
    pub(crate) fn u64_rows(&self) -> PyResult<(Vec<u64>, usize)> {
        let fmt = if self.raw.format.is_null() {
            "B".to_owned()
        } else {
            // SAFETY: a requested format is a NUL-terminated string owned
            // by the exporter until release.
            unsafe { CStr::from_ptr(self.raw.format) }
                .to_string_lossy()
                .into_owned()
        };
        let code = fmt.trim_start_matches(['<', '=', '@', '!']);
        if self.raw.itemsize != 8 || !matches!(code, "Q" | "L" | "q" | "l" | "K" | "N" | "n") {
            return Err(invalid(format!(
                "descriptor arrays hold 8-byte integers (numpy uint64 or int64), not format {fmt:?}"
            )));
        }
        // SAFETY: a C-contiguous request fills `shape` with `ndim` entries.
        let shape: &[ffi::Py_ssize_t] = if self.raw.ndim == 0 || self.raw.shape.is_null() {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(self.raw.shape, self.raw.ndim as usize) }
        };
        let cols = match shape {
            [_, c] if *c == 2 || *c == 3 => *c as usize,
            [n] if n % 2 == 0 => 2,
            _ => {
                return Err(invalid(format!(
                "descriptor arrays are shaped (N, 2) or (N, 3) (addr, len[, dev]), not {shape:?}"
            )))
            }
        };
        let n = self.len() / 8;
        // SAFETY: the buffer is C-contiguous, `len` bytes of 8-byte items,
        // valid while `self` holds it; unaligned reads make no assumption
        // about its alignment.
        let words: Vec<u64> = (0..n)
            .map(|i| unsafe { self.ptr().cast::<u64>().add(i).read_unaligned() })
            .collect();
        Ok((words, cols))
    }
}

impl Drop for BufferView {
    fn drop(&mut self) {
        // The last holder can be a runtime thread that lets go after the
        // interpreter shut down (a registration dropped at exit); then the
        // view is left to the exiting process, not released without a GIL.
        let _ = Python::try_attach(|_| {
            // SAFETY: the view was filled by a successful
            // `PyObject_GetBuffer` and is released exactly once, with the GIL.
            unsafe { PyBuffer_Release(&mut *self.raw) }
        });
    }
}
