//! Where a replay runs: the simulated device (address-only, the default) or a real GPU through
//! the runtime's CUDA backend (`cuda:N`). On a GPU the replay makes the same allocator calls and
//! the allocator makes real driver calls (cuMemAlloc, or cuMemCreate/cuMemMap for growable
//! segments); no kernel runs and no byte is touched. The capacity is then a limit on what the
//! allocator may hold (`set_memory_limit`, PyTorch's `set_per_process_memory_fraction`), which
//! fails growth exactly where the simulated device of that capacity would.

#[cfg(feature = "cuda")]
use std::collections::HashMap;
use std::sync::Arc;

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::backend::{Backend, StreamId};
use oomguard_runtime::{AllocatorConfig, ByteSize};

/// The default simulated capacity: an 80 GiB H100.
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// Which device a replay runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The address-only simulated device.
    #[default]
    Sim,
    /// The simulated device as a GPU run uses one: an 80 GiB device, the capacity imposed as a
    /// memory limit (`sim-limit`; to check that the GPU method measures what `sim` does).
    SimLimit,
    /// CUDA device `N` (the real driver; only addresses are used).
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    /// `sim`, `sim-limit`, `cuda` (device 0) or `cuda:N`.
    ///
    /// ```
    /// use oomguard_cli::device::DeviceSpec;
    /// assert_eq!("sim".parse(), Ok(DeviceSpec::Sim));
    /// assert_eq!("cuda:1".parse(), Ok(DeviceSpec::Cuda(1)));
    /// assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("sim, sim-limit or cuda:N"));
    /// ```
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "sim" => Ok(DeviceSpec::Sim),
            "sim-limit" => Ok(DeviceSpec::SimLimit),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            t => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| format!("unknown device {t:?}: expected sim, sim-limit or cuda:N")),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Sim => f.write_str("sim"),
            DeviceSpec::SimLimit => f.write_str("sim-limit"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// An opened device: the backend the allocator runs on, whether its capacity must be imposed as
/// a limit, and how trace streams map to the device's streams.
pub struct Opened {
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// Impose the capacity with `set_memory_limit` (a real device has its own capacity).
    pub limit: bool,
    streams: Streams,
}

enum Streams {
    /// Trace stream handles are used as they are (the simulated device only keys pools by them).
    AsIs,
    #[cfg(feature = "cuda")]
    Cuda {
        backend: Arc<oomguard_runtime::backend::cuda::CudaBackend>,
        map: HashMap<u64, StreamId>,
    },
}

impl Opened {
    /// The device stream for trace stream `s`: on a GPU, 0 stays the default stream and each
    /// other handle gets a stream of its own (the trace's handles belong to another process).
    pub fn stream(&mut self, s: u64) -> Result<StreamId, String> {
        match &mut self.streams {
            Streams::AsIs => Ok(s),
            #[cfg(feature = "cuda")]
            Streams::Cuda { backend, map } => {
                if s == 0 {
                    return Ok(0);
                }
                if let Some(id) = map.get(&s) {
                    return Ok(*id);
                }
                let stream = backend
                    .context()
                    .new_stream()
                    .map_err(|e| format!("cuStreamCreate: {e:?}"))?;
                let id = backend
                    .register_stream(&stream)
                    .map_err(|e| e.to_string())?;
                map.insert(s, id);
                Ok(id)
            }
        }
    }
}

/// Opens `spec` for a replay with `capacity` bytes and `config`, the simulated device with
/// pages of `page_size` bytes when given (2 MiB otherwise). A GPU that cannot be opened (no
/// driver, no such device, a build without the `cuda` feature), a page size the simulated
/// device refuses, or a page size for a GPU is an error in one line.
pub fn open(
    spec: &DeviceSpec,
    capacity: u64,
    config: &AllocatorConfig,
    page_size: Option<u64>,
) -> Result<Opened, String> {
    let sim = |capacity: u64| -> Result<Arc<dyn Backend>, String> {
        let d = SimDevice::address_only(ByteSize(capacity));
        let d = match page_size {
            Some(p) => d
                .with_page_size(p)
                .map_err(|e| format!("--page-size: {}", e.message))?,
            None => d,
        };
        Ok(Arc::new(d))
    };
    match spec {
        DeviceSpec::Sim => Ok(Opened {
            backend: sim(capacity)?,
            limit: false,
            streams: Streams::AsIs,
        }),
        DeviceSpec::SimLimit => Ok(Opened {
            backend: sim(DEFAULT_CAPACITY)?,
            limit: true,
            streams: Streams::AsIs,
        }),
        DeviceSpec::Cuda(n) if page_size.is_some() => Err(format!(
            "--page-size applies to the simulated device; cuda:{n} maps pages of its driver's granularity"
        )),
        DeviceSpec::Cuda(n) => open_cuda(*n, config),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, config: &AllocatorConfig) -> Result<Opened, String> {
    use oomguard_runtime::backend::cuda::CudaBackend;
    let b = CudaBackend::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e}"))?;
    // As `Device::cuda_with_config`: the pass-through baseline takes segments from the
    // stream-ordered pool.
    let b = Arc::new(if config.pass_through {
        b.with_stream_ordered_pool()
    } else {
        b
    });
    Ok(Opened {
        backend: b.clone(),
        limit: true,
        streams: Streams::Cuda {
            backend: b,
            map: HashMap::new(),
        },
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize, _config: &AllocatorConfig) -> Result<Opened, String> {
    Err(format!(
        "cuda:{ordinal}: this oomguard was built without the `cuda` feature"
    ))
}
