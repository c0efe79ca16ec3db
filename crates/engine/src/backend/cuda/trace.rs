//! A timeline of the decode kernels, for finding where a step's time goes between and
//! inside kernels (Nsight Compute serializes kernels, so it cannot show PDL overlap, and the
//! GPU machine has no Nsight Systems). `CudaConfig::trace` (`FERROLM_TRACE=<file>`): kernels are compiled with
//! TRACE=1 (trace.cuh) and sampled blocks of the traced kernels record, in one device buffer,
//! when they start, when their `pdl_wait` returns and when they end (%globaltimer ns, with
//! the launch's %gridid, SM and block). The buffer is written to the file when the device is
//! dropped; `tools/profile/trace_table.py` turns it into a per-step table. Recording costs
//! one atomic per sampled block and event, so traced runs are a little slower: a tool for
//! where the time goes, not for tokens/s.

use super::driver::drv;
use crate::Result;
use cudarc::driver::{CudaModule, CudaSlice, CudaStream, DevicePtr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Records the buffer holds (16 bytes each): a few thousand per decode step.
const CAP: u64 = 1 << 23;

pub(crate) struct Trace {
    /// [0] records written (may pass CAP: later ones are dropped), [1] CAP, then 2 u64 per
    /// record (trace.cuh's layout).
    buf: CudaSlice<u64>,
    path: PathBuf,
    /// Modules loaded while a graph was being captured: their `trace_buf` is set at the next
    /// launch outside a capture (a copy inside a capture would become a graph node).
    pending: Mutex<Vec<Arc<CudaModule>>>,
}

impl Trace {
    /// A trace to be written to `path`.
    pub(crate) fn new(stream: &Arc<CudaStream>, path: &std::path::Path) -> Result<Trace> {
        let mut buf = stream.alloc_zeros::<u64>(2 + 2 * CAP as usize).map_err(drv("allocating the trace buffer"))?;
        stream.memcpy_htod(&[CAP], &mut buf.slice_mut(1..2)).map_err(drv("initializing the trace buffer"))?;
        eprintln!("ferrolm: tracing decode kernels into {}", path.display());
        Ok(Trace { buf, path: path.to_path_buf(), pending: Mutex::new(Vec::new()) })
    }

    /// The defines every kernel is compiled with while tracing: TRACE=1, and with `all`
    /// (`CudaConfig::trace_all`) TRACE_ALL=1 (every block, and an end per warp: trace.cuh).
    pub(crate) fn defines(all: bool) -> Vec<String> {
        let mut d = vec!["TRACE=1".to_string()];
        if all {
            d.push("TRACE_ALL=1".into());
        }
        d
    }

    /// Point a newly loaded module's `trace_buf` at the buffer, now or (while capturing)
    /// at the next `flush`.
    pub(crate) fn attach(&self, stream: &Arc<CudaStream>, m: &Arc<CudaModule>, capturing: bool) -> Result<()> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).push(m.clone());
        if capturing {
            return Ok(());
        }
        self.flush(stream)
    }

    /// Attach the modules loaded during a capture (call outside captures).
    pub(crate) fn flush(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let addr = self.buf.device_ptr(stream).0;
        for m in pending.drain(..) {
            // A module without the symbol (no traced kernel kept it) records nothing.
            if let Ok(mut g) = m.get_global("trace_buf", stream) {
                stream.memcpy_htod(&addr.to_le_bytes()[..], &mut g).map_err(drv("setting a module's trace buffer"))?;
            }
        }
        Ok(())
    }

    /// Write the records to the file: little-endian u64s, the count (capped at CAP), then
    /// 2 per record.
    pub(crate) fn dump(&self, stream: &Arc<CudaStream>) -> Result<()> {
        // The count first, then only the records written (the buffer is 256 MB).
        let count = stream.clone_dtoh(&self.buf.slice(0..1)).map_err(drv("reading the trace buffer"))?;
        let n = count[0].min(CAP) as usize;
        let records = match n {
            0 => Vec::new(),
            _ => stream.clone_dtoh(&self.buf.slice(2..2 + 2 * n)).map_err(drv("reading the trace buffer"))?,
        };
        let mut bytes = Vec::with_capacity(8 * (1 + 2 * n));
        bytes.extend((n as u64).to_le_bytes());
        for v in &records {
            bytes.extend(v.to_le_bytes());
        }
        std::fs::write(&self.path, bytes).map_err(|e| crate::Error::io(&self.path, e))?;
        eprintln!("ferrolm: wrote {n} trace records to {}", self.path.display());
        Ok(())
    }
}
