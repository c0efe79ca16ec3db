//! GPUs as ranks, one process driving them all: NCCL (loaded at run time, as the rest of
//! CUDA) between their streams. The embedding: each rank writes the rows of the ids its
//! part of the vocabulary holds and zeros elsewhere, and an all-reduce sums them (one
//! nonzero term per value: exact). The output projections: each rank's partial product,
//! then an all-reduce (sum) in the activations' precision.

use super::Collective;
use crate::backend::cuda::{ActBuf, Cuda, CudaAct, CudaMat};
use crate::backend::Backend;
use crate::{Error, Result};
use cudarc::nccl::{result as nr, Comm, ReduceOp};
use std::sync::Mutex;

/// The ranks' communicators, one per GPU, in rank order.
pub struct Nccl {
    comms: Mutex<Vec<Comms>>,
}

/// A communicator, moved between threads only inside the mutex that keeps its use
/// exclusive.
struct Comms(Comm);

// SAFETY: a communicator is a handle NCCL allows any thread to use, one call at a time;
// `Nccl` hands it out only under its mutex.
unsafe impl Send for Comms {}

fn nccl(what: &str) -> impl Fn(nr::NcclError) -> Error + '_ {
    move |e| Error::Invalid(format!("NCCL {what}: {e:?}"))
}

impl Nccl {
    /// Communicators between `ranks` (each on its own GPU).
    pub fn new(ranks: &[Cuda]) -> Result<Nccl> {
        // SAFETY: only tries to open the library (cudarc panics on a missing one later).
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "tensor parallelism on GPUs needs NCCL: no libnccl.so on the library path (PyTorch's nvidia/nccl/lib has libnccl.so.2; link it as libnccl.so)".into(),
            ));
        }
        let streams = ranks.iter().map(|c| c.stream.clone()).collect();
        let comms = Comm::from_devices(streams).map_err(nccl("creating the communicators"))?;
        Ok(Nccl { comms: Mutex::new(comms.into_iter().map(Comms).collect()) })
    }

    /// Every rank's `xs[r]` replaced by the sum over ranks, in one NCCL group (one
    /// thread drives every GPU).
    fn all_reduce(&self, xs: &mut [&mut CudaAct]) -> Result<()> {
        let comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        nr::group_start().map_err(nccl("group start"))?;
        let mut r = Ok(());
        for (c, x) in comms.iter().zip(xs.iter_mut()) {
            let n = x.rows * x.cols;
            r = r.and(match &mut x.buf {
                ActBuf::Bf16(b) => match unsafe { b.transmute_mut::<half::bf16>(n) } {
                    // SAFETY (above): the u16 buffer holds n bf16 values (same size and
                    // alignment).
                    Some(mut v) => c.0.all_reduce_in_place(&mut v, &ReduceOp::Sum).map(|_| ()),
                    None => Err(nr::NcclError(cudarc::nccl::sys::ncclResult_t::ncclInvalidArgument)),
                },
                ActBuf::F32(b) => c.0.all_reduce_in_place(b, &ReduceOp::Sum).map(|_| ()),
            });
        }
        let end = nr::group_end();
        r.map_err(nccl("all-reduce"))?;
        end.map_err(nccl("group end")).map(|_| ())
    }
}

impl Collective<Cuda> for Nccl {
    fn embed(
        &self,
        ranks: &[Cuda],
        tables: &[&CudaMat],
        firsts: &[usize],
        tokens: &[u32],
        scale: f32,
        xs: &mut [&mut CudaAct],
    ) -> Result<()> {
        for (r, b) in ranks.iter().enumerate() {
            b.embed_rows(tables[r], tokens.len(), scale, xs[r], firsts[r])?;
        }
        self.all_reduce(xs)
    }

    fn row_parallel(&self, ranks: &[Cuda], ys: &[&CudaAct], ws: &[&CudaMat], outs: &mut [&mut CudaAct]) -> Result<()> {
        for (r, b) in ranks.iter().enumerate() {
            b.matmul(ys[r], ws[r], outs[r])?;
        }
        self.all_reduce(outs)
    }
}
