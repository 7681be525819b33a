//! The stream registry: [`StreamId`]s are raw `CUstream` handle values; registered cudarc
//! streams are kept alive here so that an id always names the same stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};

use super::{invalid, lock};
use crate::backend::{BackendError, StreamId};

#[derive(Debug)]
pub(super) struct StreamRegistry {
    default: Arc<CudaStream>,
    streams: Mutex<HashMap<StreamId, Arc<CudaStream>>>,
}

/// The id of a cudarc stream: its handle's value (0 for the legacy default stream).
pub(super) fn id_of(stream: &CudaStream) -> StreamId {
    stream.cu_stream() as usize as StreamId
}

impl StreamRegistry {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Self {
        Self {
            default: ctx.default_stream(),
            streams: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn default_stream(&self) -> Arc<CudaStream> {
        Arc::clone(&self.default)
    }

    pub(super) fn register(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
    ) -> Result<StreamId, BackendError> {
        if stream.context().cu_ctx() != ctx.cu_ctx() {
            return Err(invalid(
                "register_stream",
                format!(
                    "the stream belongs to CUDA device {}, not to device {}",
                    stream.context().ordinal(),
                    ctx.ordinal()
                ),
            ));
        }
        let id = id_of(stream);
        if id != 0 {
            lock(&self.streams)
                .entry(id)
                .or_insert_with(|| Arc::clone(stream));
        }
        Ok(id)
    }

    pub(super) fn get(&self, id: StreamId) -> Result<Arc<CudaStream>, BackendError> {
        if id == 0 {
            return Ok(self.default_stream());
        }
        lock(&self.streams).get(&id).cloned().ok_or_else(|| {
            invalid(
                "stream",
                format!("stream {id:#x} is not registered with this device (register_stream)"),
            )
        })
    }
}
