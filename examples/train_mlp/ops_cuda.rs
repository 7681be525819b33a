//! The MLP's math on an NVIDIA GPU: cuBLAS SGEMM for the matrix products, NVRTC-compiled kernels
//! for the rest. Every array is an oomguard buffer.

use std::sync::Arc;

use oomguard::backend::{BackendError, BackendErrorKind};
use oomguard::cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use oomguard::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use oomguard::{Device, DeviceBuffer, Error};

use crate::ops::Ops;

const KERNELS: &str = r#"
__device__ float hash_unit(unsigned long long seed, unsigned long long row, unsigned long long col) {
    unsigned long long z = seed ^ (row * 0x9e3779b97f4a7c15ULL) ^ (col * 0xc2b2ae3d27d4eb4fULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return ((float)(z >> 40) / 16777216.0f) * 2.0f - 1.0f;
}
extern "C" __global__ void gen_x(float* x, unsigned long long seed, long long row0, long long n, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = hash_unit(seed, (unsigned long long)(row0 + i / cols), (unsigned long long)(i % cols));
}
extern "C" __global__ void gen_y(unsigned* y, unsigned long long seed, long long row0, int rows, int classes) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int best = 0; float bv = hash_unit(seed, row0 + r, 0);
    for (int c = 1; c < classes; c++) { float v = hash_unit(seed, row0 + r, c); if (v > bv) { bv = v; best = c; } }
    y[r] = best;
}
extern "C" __global__ void bias_act(float* h, const float* b, long long n, int cols, int relu) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = h[i] + b[i % cols]; h[i] = (relu && v < 0.0f) ? 0.0f : v; }
}
extern "C" __global__ void relu_grad(float* dh, const float* h, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && h[i] <= 0.0f) dh[i] = 0.0f;
}
extern "C" __global__ void bias_grad(const float* dz, float* db, int rows, int cols) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += dz[(long long)r * cols + j];
    db[j] += s;
}
extern "C" __global__ void softmax_xent(const float* logits, const unsigned* labels, float* dl,
                                        double* loss, unsigned* correct, int rows, int cols,
                                        float scale, int want_grad) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = logits + (long long)r * cols;
    float mx = row[0]; int arg = 0;
    for (int j = 1; j < cols; j++) if (row[j] > mx) { mx = row[j]; arg = j; }
    float sum = 0.0f;
    for (int j = 0; j < cols; j++) sum += expf(row[j] - mx);
    unsigned label = labels[r];
    atomicAdd(loss, (double)(logf(sum) + mx - row[label]));
    if (arg == (int)label) atomicAdd(correct, 1u);
    if (want_grad) for (int j = 0; j < cols; j++)
        dl[(long long)r * cols + j] = (expf(row[j] - mx) / sum - (j == (int)label ? 1.0f : 0.0f)) * scale;
}
extern "C" __global__ void sgd(float* w, const float* g, float lr, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) w[i] -= lr * g[i];
}
"#;

/// cuBLAS and NVRTC kernels on the device's default stream.
pub struct CudaOps {
    dev: Device,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: std::collections::HashMap<&'static str, CudaFunction>,
}

fn other(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Backend(BackendError::new(
        BackendErrorKind::Other,
        op,
        e.to_string(),
    ))
}

fn blas_err(e: oomguard::cudarc::cublas::result::CublasError) -> Error {
    // cuBLAS runs out of workspace memory as CUBLAS_STATUS_ALLOC_FAILED: an out-of-memory.
    let kind = if e.0 == oomguard::cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED {
        BackendErrorKind::OutOfMemory
    } else {
        BackendErrorKind::Other
    };
    Error::Backend(BackendError::new(kind, "cublasSgemm", e.to_string()))
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaOps {
    pub fn new(dev: &Device) -> Result<Self, Error> {
        let stream = dev.cuda_default_stream()?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| other("cublasCreate", e))?;
        let ptx = oomguard::cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| other("nvrtc", e))?;
        let module = dev
            .cuda_context()?
            .load_module(ptx)
            .map_err(|e| other("cuModuleLoad", e))?;
        let mut f = std::collections::HashMap::new();
        for name in [
            "gen_x",
            "gen_y",
            "bias_act",
            "relu_grad",
            "bias_grad",
            "softmax_xent",
            "sgd",
        ] {
            f.insert(
                name,
                module
                    .load_function(name)
                    .map_err(|e| other("cuModuleGetFunction", e))?,
            );
        }
        Ok(Self {
            dev: dev.clone(),
            stream,
            blas,
            f,
        })
    }

    fn func(&self, name: &str) -> &CudaFunction {
        &self.f[name]
    }
}

macro_rules! launch {
    ($self:ident, $name:literal, $n:expr, $($arg:expr),*) => {{
        let threads = $n;
        let mut b = $self.stream.launch_builder($self.func($name));
        $(b.arg($arg);)*
        // SAFETY: the kernels above take exactly these arguments, in this order, and index
        // only below the element counts passed with them, which match the buffers' lengths.
        unsafe { b.launch(grid(threads)) }.map_err(|e| other($name, e))?;
    }};
}

impl Ops for CudaOps {
    fn gemm(
        &self,
        a: &DeviceBuffer<f32>,
        ta: bool,
        b: &DeviceBuffer<f32>,
        tb: bool,
        c: &mut DeviceBuffer<f32>,
        m: usize,
        n: usize,
        k: usize,
        beta: f32,
    ) -> Result<(), Error> {
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ.
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = GemmConfig {
            transa: op(tb),
            transb: op(ta),
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: if tb { k } else { n } as i32,
            ldb: if ta { m } else { k } as i32,
            beta,
            ldc: n as i32,
        };
        let (av, bv) = (a.cuda_view()?, b.cuda_view()?);
        let mut cv = c.cuda_view_mut()?;
        // SAFETY: the leading dimensions and sizes above describe exactly the row-major
        // matrices a[m×k] (or [k×m]), b[k×n] (or [n×k]) and c[m×n] held by the buffers.
        unsafe { self.blas.gemm(cfg, &bv, &av, &mut cv) }.map_err(blas_err)
    }

    fn bias_act(
        &self,
        h: &mut DeviceBuffer<f32>,
        bias: &DeviceBuffer<f32>,
        cols: usize,
        relu: bool,
    ) -> Result<(), Error> {
        let (n, cols, relu) = (h.len() as i64, cols as i32, relu as i32);
        launch!(self, "bias_act", h.len(), &mut *h, bias, &n, &cols, &relu);
        Ok(())
    }

    fn relu_grad(&self, dh: &mut DeviceBuffer<f32>, h: &DeviceBuffer<f32>) -> Result<(), Error> {
        let n = dh.len() as i64;
        launch!(self, "relu_grad", dh.len(), &mut *dh, h, &n);
        Ok(())
    }

    fn bias_grad(
        &self,
        dz: &DeviceBuffer<f32>,
        db: &mut DeviceBuffer<f32>,
        cols: usize,
    ) -> Result<(), Error> {
        let (rows, c) = ((dz.len() / cols) as i32, cols as i32);
        launch!(self, "bias_grad", cols, dz, &mut *db, &rows, &c);
        Ok(())
    }

    fn softmax_xent(
        &self,
        logits: &DeviceBuffer<f32>,
        labels: &DeviceBuffer<u32>,
        dlogits: Option<&mut DeviceBuffer<f32>>,
        cols: usize,
        scale: f32,
    ) -> Result<(f64, u64), Error> {
        let rows = labels.len();
        let mut loss = self.dev.zeros::<f64>(1)?;
        let mut correct = self.dev.zeros::<u32>(1)?;
        let (r, c) = (rows as i32, cols as i32);
        match dlogits {
            Some(dl) => {
                let want = 1i32;
                launch!(
                    self,
                    "softmax_xent",
                    rows,
                    logits,
                    labels,
                    &mut *dl,
                    &mut loss,
                    &mut correct,
                    &r,
                    &c,
                    &scale,
                    &want
                );
            }
            None => {
                // no gradient wanted: a 1-element dummy target is never written
                let mut dummy = self.dev.zeros::<f32>(1)?;
                let want = 0i32;
                launch!(
                    self,
                    "softmax_xent",
                    rows,
                    logits,
                    labels,
                    &mut dummy,
                    &mut loss,
                    &mut correct,
                    &r,
                    &c,
                    &scale,
                    &want
                );
            }
        }
        Ok((loss.to_vec()?[0], correct.to_vec()?[0] as u64))
    }

    fn sgd(&self, w: &mut DeviceBuffer<f32>, g: &DeviceBuffer<f32>, lr: f32) -> Result<(), Error> {
        let n = w.len() as i64;
        launch!(self, "sgd", w.len(), &mut *w, g, &lr, &n);
        Ok(())
    }

    fn zero(&self, x: &mut DeviceBuffer<f32>) -> Result<(), Error> {
        Ok(self
            .dev
            .backend()
            .memset_zero(x.device_ptr(), x.byte_len())?)
    }

    fn gen_data(
        &self,
        x: &mut DeviceBuffer<f32>,
        labels: &mut DeviceBuffer<u32>,
        seed: u64,
        row0: usize,
        cols: usize,
        classes: usize,
    ) -> Result<(), Error> {
        let rows = labels.len();
        let (n, c, r0) = (x.len() as i64, cols as i32, row0 as i64);
        launch!(self, "gen_x", x.len(), &mut *x, &seed, &r0, &n, &c);
        let (r, k) = (rows as i32, classes as i32);
        launch!(self, "gen_y", rows, &mut *labels, &seed, &r0, &r, &k);
        Ok(())
    }
}
