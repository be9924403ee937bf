//! Registrations: [`Memory`] (a buffer-protocol object, zero-copy, a GPU
//! array through `__cuda_array_interface__`, or foreign memory by
//! pointer), [`KvLayout`], and descriptor lists.

use crate::buffer::BufferView;
use crate::errors::{invalid, to_py};
use kvlane::data::{
    gpu_device_of, Access, GpuDevice, GpuRuntime, KvParts, LayoutOrder, MemoryKind, Region,
};
use kvlane::MemSpan;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::types::{PyList, PyTuple};

/// Memory registered for transfers. Build it from any buffer-protocol
/// object (`Memory(numpy_array)`, `Memory(bytearray(n))`, `Memory(mmap)`):
/// zero-copy, the object's buffer is held (it cannot resize or close) as
/// long as the registration lives. A read-only buffer (or `readonly=True`)
/// registers without write rights: peers may READ it, nobody may write it.
/// A GPU array (a torch CUDA tensor, a CuPy array: any object with a
/// C-contiguous `__cuda_array_interface__`) registers as GPU memory of the
/// device the driver says it is on; the object is kept alive as long as
/// the registration.
#[pyclass(module = "kvlane", frozen, name = "Memory")]
pub(crate) struct Memory {
    pub(crate) region: Region,
    readonly: bool,
}

impl Memory {
    fn new(region: Region, readonly: bool) -> Self {
        Self { region, readonly }
    }

    /// `obj` as a registration: a `Memory` as it is, else its buffer.
    pub(crate) fn coerce(obj: &Bound<'_, PyAny>) -> PyResult<Region> {
        if let Ok(m) = obj.cast::<Self>() {
            return Ok(m.get().region.clone());
        }
        Ok(Self::from_buffer(obj, None)?.region)
    }

    fn from_buffer(obj: &Bound<'_, PyAny>, readonly: Option<bool>) -> PyResult<Self> {
        if obj.hasattr("__cuda_array_interface__")? {
            return Self::from_cuda_array(obj, readonly);
        }
        let view = match readonly {
            Some(true) => BufferView::acquire(obj, false, false)?,
            Some(false) => BufferView::acquire(obj, true, false)?,
            None => BufferView::acquire(obj, true, false)
                .or_else(|_| BufferView::acquire(obj, false, false))?,
        };
        let ro = readonly.unwrap_or(false) || view.readonly();
        let access = if ro { Access::REMOTE_READ } else { Access::ALL };
        let (ptr, len) = (view.ptr(), view.len());
        // A whole `kvlane.host_buffer` array: its shareable region, which
        // shm can pass to a peer on this host (read-only registrations of
        // it stay foreign memory: the file is not sealed read-only).
        if !ro {
            if let Some(region) = crate::shared::region_at(ptr as u64, len as u64) {
                return Ok(Self::new(region, false));
            }
        }
        // SAFETY: `ptr..ptr+len` is the exporter's buffer, kept valid and in
        // place by `view` (the exporter refuses to resize or free it while a
        // view is held), and `view` is the region's keep-alive: it is
        // released only after the last clone of the region (and every
        // backend registration of it) is gone. Read-only buffers get no
        // write right, so no backend writes into them.
        let region =
            unsafe { Region::from_raw(ptr, len, MemoryKind::Host, access, Some(Box::new(view))) }
                .map_err(|e| to_py(e.into()))?;
        Ok(Self::new(region, ro))
    }
}

/// `(data pointer, bytes, read-only)` of a `__cuda_array_interface__`
/// (version 2 or 3): C-contiguous only.
fn cuda_array(obj: &Bound<'_, PyAny>) -> PyResult<(u64, usize, bool)> {
    let cai = obj.getattr("__cuda_array_interface__")?;
    let cai = cai
        .cast::<PyDict>()
        .map_err(|_| invalid("__cuda_array_interface__ is not a dict"))?;
    let field = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(k)?
            .ok_or_else(|| invalid(format!("__cuda_array_interface__ has no {k:?}")))
    };
    let (ptr, ro): (u64, bool) = field("data")?.extract()?;
    let shape: Vec<usize> = field("shape")?.extract()?;
    let typestr: String = field("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| invalid(format!("__cuda_array_interface__ typestr {typestr:?}")))?;
    let count = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid("__cuda_array_interface__ shape overflows"))?;
    if let Some(strides) = cai.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<isize> = strides.extract()?;
        let mut want = itemsize as isize;
        for (&dim, &stride) in shape.iter().zip(&strides).rev() {
            if dim > 1 && stride != want {
                return Err(invalid(format!(
                    "only C-contiguous GPU arrays can be registered (strides {strides:?} for shape {shape:?})"
                )));
            }
            want *= dim as isize;
        }
    }
    let nbytes = count
        .checked_mul(itemsize)
        .ok_or_else(|| invalid("__cuda_array_interface__ size overflows"))?;
    Ok((ptr, nbytes, ro))
}

/// `"cuda:N"` / `"rocm:N"` (`"cuda"` / `"rocm"` mean device 0); `None` for
/// host memory names.
fn parse_device(device: &str) -> PyResult<Option<GpuDevice>> {
    Ok(match device {
        "cpu" | "DRAM" | "host" => None,
        "cuda" | "VRAM" => Some(GpuDevice::cuda(0)),
        "rocm" | "hip" => Some(GpuDevice::rocm(0)),
        d => Some(d.parse().map_err(|e| invalid(format!("{e}, or \"cpu\"")))?),
    })
}

impl Memory {
    fn from_cuda_array(obj: &Bound<'_, PyAny>, readonly: Option<bool>) -> PyResult<Self> {
        let (ptr, nbytes, ro) = cuda_array(obj)?;
        if nbytes == 0 || ptr == 0 {
            return Err(invalid("cannot register an empty GPU array"));
        }
        // ROCm builds of torch and CuPy speak the same interface.
        let runtimes = [GpuRuntime::Cuda, GpuRuntime::Rocm];
        let mut first_err = None;
        let mut device = None;
        for rt in runtimes {
            match gpu_device_of(rt, ptr) {
                Ok(Some(d)) => {
                    device = Some(d);
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let Some(device) = device else {
            return Err(match first_err {
                Some(e) => to_py(kvlane::data::DataError::from(e).into()),
                None => invalid(format!(
                    "__cuda_array_interface__ pointer {ptr:#x} is not GPU memory of any device"
                )),
            });
        };
        let ro = readonly.unwrap_or(false) || ro;
        let owner: Py<PyAny> = obj.clone().unbind();
        Self::gpu(device, ptr, nbytes, ro, Some(owner))
    }

    fn gpu(
        device: GpuDevice,
        ptr: u64,
        nbytes: usize,
        readonly: bool,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let access = if readonly {
            Access::REMOTE_READ
        } else {
            Access::ALL
        };
        let keep = owner.map(|o| Box::new(o) as Box<dyn std::any::Any + Send + Sync>);
        // SAFETY: the caller's contract (`unsafe_from_ptr`) or the array
        // interface's (the pointer is the array's memory while the array
        // lives; `owner` keeps it alive as long as the region): the device
        // range outlives every clone of the region. The driver checks that
        // it is memory of `device`.
        let region = unsafe { Region::from_device_ptr(device, ptr, nbytes, access, keep) }
            .map_err(|e| to_py(e.into()))?;
        Ok(Self::new(region, readonly))
    }
}

#[pymethods]
impl Memory {
    #[new]
    #[pyo3(signature = (obj, *, readonly = None))]
    fn py_new(obj: &Bound<'_, PyAny>, readonly: Option<bool>) -> PyResult<Self> {
        Self::from_buffer(obj, readonly)
    }

    /// Registers foreign memory by address: `nbytes` at `ptr` (a torch
    /// tensor's `data_ptr()`, memory of another library).
    ///
    /// Contract (unchecked; breaking it corrupts memory): `ptr..ptr+nbytes`
    /// is host memory valid for reads (and writes, unless `readonly`) from
    /// any thread, and stays allocated and in place until this `Memory`,
    /// every agent it was registered with, and every transfer using it are
    /// gone; `owner` (for instance the tensor) is kept alive that long.
    /// Bytes targeted by an in-flight transfer must not be touched by other
    /// code. `device` is `"cpu"` or a GPU (`"cuda:0"`, `"rocm:1"`), where
    /// the same holds for device memory and the driver must confirm that
    /// `ptr` is memory of that device.
    #[staticmethod]
    #[pyo3(signature = (ptr, nbytes, device = "cpu", *, readonly = false, owner = None))]
    fn unsafe_from_ptr(
        ptr: usize,
        nbytes: usize,
        device: &str,
        readonly: bool,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        if let Some(gpu) = parse_device(device)? {
            return Self::gpu(gpu, ptr as u64, nbytes, readonly, owner);
        }
        let access = if readonly {
            Access::REMOTE_READ
        } else {
            Access::ALL
        };
        let keep = owner.map(|o| Box::new(o) as Box<dyn std::any::Any + Send + Sync>);
        // SAFETY: the caller's contract above is `Region::from_raw`'s: the
        // memory outlives every clone of the region; `owner` is kept alive
        // by the region.
        let region =
            unsafe { Region::from_raw(ptr as *mut u8, nbytes, MemoryKind::Host, access, keep) }
                .map_err(|e| to_py(e.into()))?;
        Ok(Self::new(region, readonly))
    }

    /// Address of the first byte.
    #[getter]
    fn addr(&self) -> u64 {
        self.region.addr()
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.region.len()
    }

    /// Registered without write rights.
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// `"cpu"`, or the GPU (`"cuda:0"`).
    #[getter]
    fn device(&self) -> String {
        self.region
            .device()
            .map_or_else(|| "cpu".to_owned(), |d| d.to_string())
    }

    fn __len__(&self) -> usize {
        self.region.len() as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "Memory(addr={:#x}, nbytes={}, readonly={}, device={:?})",
            self.region.addr(),
            self.region.len(),
            self.readonly,
            self.device()
        )
    }
}

/// KV-cache geometry (see the Rust `KvLayout`): `layers` x `blocks` blocks
/// of `block_bytes`, K and V `"separate"` (two parts) or `"fused"`, in
/// `"layer_major"` or `"block_major"` order.
#[pyclass(module = "kvlane", frozen, name = "KvLayout")]
#[derive(Clone, Copy)]
pub(crate) struct KvLayout {
    pub(crate) inner: kvlane::data::KvLayout,
}

#[pymethods]
impl KvLayout {
    #[new]
    #[pyo3(signature = (layers, blocks, block_bytes, parts = "separate", order = "layer_major"))]
    fn py_new(
        layers: u32,
        blocks: u32,
        block_bytes: u64,
        parts: &str,
        order: &str,
    ) -> PyResult<Self> {
        let parts = match parts {
            "separate" => KvParts::Separate,
            "fused" => KvParts::Fused,
            p => {
                return Err(invalid(format!(
                    "parts is \"separate\" or \"fused\", not {p:?}"
                )))
            }
        };
        let order = match order {
            "layer_major" => LayoutOrder::LayerMajor,
            "block_major" => LayoutOrder::BlockMajor,
            o => {
                return Err(invalid(format!(
                    "order is \"layer_major\" or \"block_major\", not {o:?}"
                )))
            }
        };
        let inner = kvlane::data::KvLayout::new(layers, blocks, block_bytes, parts, order)
            .map_err(|e| to_py(e.into()))?;
        Ok(Self { inner })
    }

    /// Bytes a region needs to hold this cache.
    #[getter]
    fn required_len(&self) -> PyResult<u64> {
        self.inner
            .required_len()
            .ok_or_else(|| invalid("layout size overflows u64"))
    }

    /// Byte offset of `(layer, part, block)` (part 0 = K, 1 = V).
    fn offset(&self, layer: u32, part: u64, block: u32) -> PyResult<u64> {
        self.inner
            .offset(layer, part, block)
            .ok_or_else(|| invalid(format!("({layer}, {part}, {block}) is outside the layout")))
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.inner.num_layers
    }

    #[getter]
    fn blocks(&self) -> u32 {
        self.inner.num_blocks
    }

    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.block_bytes
    }

    fn __repr__(&self) -> String {
        format!(
            "KvLayout(layers={}, blocks={}, block_bytes={})",
            self.inner.num_layers, self.inner.num_blocks, self.inner.block_bytes
        )
    }
}

/// A descriptor list: an `(N, 2)` or `(N, 3)` array of 8-byte integers
/// (read in place), or a sequence of `(addr, len[, dev[, meta]])` tuples.
pub(crate) fn spans(obj: &Bound<'_, PyAny>) -> PyResult<Vec<MemSpan>> {
    // Lists and tuples are not buffers: skip the (raising) buffer request.
    let sequence = obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>();
    if let Some(view) = (!sequence)
        .then(|| BufferView::acquire(obj, false, true).ok())
        .flatten()
    {
        let (words, cols) = view.u64_rows()?;
        return Ok(words
            .chunks_exact(cols)
            .map(|row| MemSpan::new(row[0], row[1]))
            .collect());
    }
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        let t = item
            .cast::<PyTuple>()
            .map_err(|_| invalid(format!("descriptor {i} is not an (addr, len[, dev]) tuple")))?;
        if !(2..=4).contains(&t.len()) {
            return Err(invalid(format!(
                "descriptor {i} has {} fields; (addr, len[, dev[, meta]]) expected",
                t.len()
            )));
        }
        out.push(MemSpan::new(
            t.get_item(0)?.extract()?,
            t.get_item(1)?.extract()?,
        ));
    }
    Ok(out)
}
