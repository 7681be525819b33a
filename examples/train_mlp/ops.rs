//! The math the MLP needs, on device buffers. `HostOps` computes on the host (for the simulated
//! device); the CUDA implementation uses cuBLAS and NVRTC kernels.

use oomguard::{DeviceBuffer, Error};

/// Device math for the MLP; every array is an oomguard buffer. Matrices are row-major.
pub trait Ops {
    /// `c[m×n] = a[m×k] · b[k×n]` (with `a` or `b` transposed as flagged: `ta` reads `a` as
    /// `[k×m]`, `tb` reads `b` as `[n×k]`), plus `beta · c`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<(), Error>;
    /// `h[r, :] += bias`, then ReLU when `relu`.
    fn bias_act(
        &self,
        h: &mut DeviceBuffer<f32>,
        bias: &DeviceBuffer<f32>,
        cols: usize,
        relu: bool,
    ) -> Result<(), Error>;
    /// `dh *= (h > 0)`.
    fn relu_grad(&self, dh: &mut DeviceBuffer<f32>, h: &DeviceBuffer<f32>) -> Result<(), Error>;
    /// `db += column sums of dz[rows×cols]`.
    fn bias_grad(
        &self,
        dz: &DeviceBuffer<f32>,
        db: &mut DeviceBuffer<f32>,
        cols: usize,
    ) -> Result<(), Error>;
    /// Softmax cross-entropy over `logits[rows×cols]`: writes `dlogits = (p - onehot) · scale`
    /// and returns (sum of losses, number of correct argmaxes).
    fn softmax_xent(
        &self,
        logits: &DeviceBuffer<f32>,
        labels: &DeviceBuffer<u32>,
        dlogits: Option<&mut DeviceBuffer<f32>>,
        cols: usize,
        scale: f32,
    ) -> Result<(f64, u64), Error>;
    /// `w -= lr · g`.
    fn sgd(&self, w: &mut DeviceBuffer<f32>, g: &DeviceBuffer<f32>, lr: f32) -> Result<(), Error>;
    /// Sets every element to zero.
    fn zero(&self, x: &mut DeviceBuffer<f32>) -> Result<(), Error>;
    /// Synthetic, seeded, learnable data: rows `row0..row0+rows` of the data set.
    fn gen_data(
        &self,
        x: &mut DeviceBuffer<f32>,
        labels: &mut DeviceBuffer<u32>,
        seed: u64,
        row0: usize,
        cols: usize,
        classes: usize,
    ) -> Result<(), Error>;
}

/// A value in [-1, 1) from (seed, row, col): the same on host and device.
pub fn hash_unit(seed: u64, row: u64, col: u64) -> f32 {
    let mut z =
        seed ^ row.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ col.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Host math over buffers copied in and out (for the simulated device).
pub struct HostOps;

impl Ops for HostOps {
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
        let (av, bv) = (a.to_vec()?, b.to_vec()?);
        let mut cv = if beta == 0.0 {
            vec![0.0; m * n]
        } else {
            c.to_vec()?
        };
        let at = |i: usize, p: usize| if ta { av[p * m + i] } else { av[i * k + p] };
        let bt = |p: usize, j: usize| if tb { bv[j * k + p] } else { bv[p * n + j] };
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f32;
                for p in 0..k {
                    s += at(i, p) * bt(p, j);
                }
                cv[i * n + j] = s + beta * cv[i * n + j];
            }
        }
        c.copy_from_slice(&cv)
    }

    fn bias_act(
        &self,
        h: &mut DeviceBuffer<f32>,
        bias: &DeviceBuffer<f32>,
        cols: usize,
        relu: bool,
    ) -> Result<(), Error> {
        let (mut hv, bv) = (h.to_vec()?, bias.to_vec()?);
        for (i, x) in hv.iter_mut().enumerate() {
            *x += bv[i % cols];
            if relu && *x < 0.0 {
                *x = 0.0;
            }
        }
        h.copy_from_slice(&hv)
    }

    fn relu_grad(&self, dh: &mut DeviceBuffer<f32>, h: &DeviceBuffer<f32>) -> Result<(), Error> {
        let (mut d, hv) = (dh.to_vec()?, h.to_vec()?);
        for (d, h) in d.iter_mut().zip(hv) {
            if h <= 0.0 {
                *d = 0.0;
            }
        }
        dh.copy_from_slice(&d)
    }

    fn bias_grad(
        &self,
        dz: &DeviceBuffer<f32>,
        db: &mut DeviceBuffer<f32>,
        cols: usize,
    ) -> Result<(), Error> {
        let (z, mut b) = (dz.to_vec()?, db.to_vec()?);
        for (i, v) in z.iter().enumerate() {
            b[i % cols] += v;
        }
        db.copy_from_slice(&b)
    }

    fn softmax_xent(
        &self,
        logits: &DeviceBuffer<f32>,
        labels: &DeviceBuffer<u32>,
        dlogits: Option<&mut DeviceBuffer<f32>>,
        cols: usize,
        scale: f32,
    ) -> Result<(f64, u64), Error> {
        let (l, y) = (logits.to_vec()?, labels.to_vec()?);
        let mut d = vec![0.0f32; l.len()];
        let (mut loss, mut correct) = (0.0f64, 0u64);
        for (r, row) in l.chunks(cols).enumerate() {
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
            let label = y[r] as usize;
            loss += (sum.ln() + max - row[label]) as f64;
            let arg = row
                .iter()
                .enumerate()
                .fold(0, |b, (i, v)| if *v > row[b] { i } else { b });
            correct += (arg == label) as u64;
            for (j, v) in row.iter().enumerate() {
                let p = (v - max).exp() / sum;
                d[r * cols + j] = (p - (j == label) as u32 as f32) * scale;
            }
        }
        if let Some(dl) = dlogits {
            dl.copy_from_slice(&d)?;
        }
        Ok((loss, correct))
    }

    fn sgd(&self, w: &mut DeviceBuffer<f32>, g: &DeviceBuffer<f32>, lr: f32) -> Result<(), Error> {
        let (mut wv, gv) = (w.to_vec()?, g.to_vec()?);
        for (w, g) in wv.iter_mut().zip(gv) {
            *w -= lr * g;
        }
        w.copy_from_slice(&wv)
    }

    fn zero(&self, x: &mut DeviceBuffer<f32>) -> Result<(), Error> {
        x.copy_from_slice(&vec![0.0; x.len()])
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
        let mut xv = vec![0.0f32; rows * cols];
        let mut yv = vec![0u32; rows];
        for r in 0..rows {
            let row = (row0 + r) as u64;
            for c in 0..cols {
                xv[r * cols + c] = hash_unit(seed, row, c as u64);
            }
            // the label is the argmax of the first `classes` features: learnable by an MLP
            yv[r] = (0..classes).fold(0, |b, c| {
                if xv[r * cols + c] > xv[r * cols + b] {
                    c
                } else {
                    b
                }
            }) as u32;
        }
        x.copy_from_slice(&xv)?;
        labels.copy_from_slice(&yv)
    }
}
