//! The MLP: weights and gradients in oomguard buffers; forward keeps activations for backward
//! only when grad mode is on.

use oomguard::{Device, DeviceBuffer, Error};

use crate::ops::{hash_unit, Ops};

/// Layer sizes: input, hidden…, classes.
pub struct Mlp {
    pub dims: Vec<usize>,
    pub weights: Vec<DeviceBuffer<f32>>,
    pub biases: Vec<DeviceBuffer<f32>>,
    pub grad_w: Vec<DeviceBuffer<f32>>,
    pub grad_b: Vec<DeviceBuffer<f32>>,
}

/// What a forward pass kept for backward (nothing under `no_grad`).
pub struct Saved {
    /// The input of each layer (the batch, then each hidden activation).
    inputs: Vec<DeviceBuffer<f32>>,
}

impl Mlp {
    /// Weights initialised from a seeded hash (He-style scale), biases zero.
    pub fn new(dev: &Device, dims: &[usize], seed: u64) -> Result<Self, Error> {
        let mut m = Mlp {
            dims: dims.to_vec(),
            weights: Vec::new(),
            biases: Vec::new(),
            grad_w: Vec::new(),
            grad_b: Vec::new(),
        };
        for (l, w) in dims.windows(2).enumerate() {
            let (i, o) = (w[0], w[1]);
            let scale = (2.0 / i as f32).sqrt();
            let init: Vec<f32> = (0..i * o)
                .map(|k| hash_unit(seed ^ 0x5eed, l as u64, k as u64) * scale)
                .collect();
            m.weights.push(dev.from_slice(&init)?);
            m.biases.push(dev.zeros(o)?);
            m.grad_w.push(dev.zeros(i * o)?);
            m.grad_b.push(dev.zeros(o)?);
        }
        Ok(m)
    }

    pub fn classes(&self) -> usize {
        *self.dims.last().unwrap_or(&1)
    }

    /// Logits of `x[rows × dims[0]]`. With grad mode on, the layer inputs are kept for
    /// backward; with it off each activation is dropped as soon as the next one exists.
    pub fn forward(
        &self,
        dev: &Device,
        ops: &dyn Ops,
        x: DeviceBuffer<f32>,
        rows: usize,
    ) -> Result<(DeviceBuffer<f32>, Option<Saved>), Error> {
        let keep = oomguard::is_grad_enabled();
        let mut saved = Vec::new();
        let mut h = x;
        let layers = self.weights.len();
        for l in 0..layers {
            let (i, o) = (self.dims[l], self.dims[l + 1]);
            let mut z = dev.alloc::<f32>(rows * o)?;
            ops.gemm(&h, false, &self.weights[l], false, &mut z, rows, o, i, 0.0)?;
            ops.bias_act(&mut z, &self.biases[l], o, l + 1 < layers)?;
            let prev = std::mem::replace(&mut h, z);
            if keep {
                saved.push(prev);
            }
        }
        Ok((h, keep.then_some(Saved { inputs: saved })))
    }

    /// Backward from `dlogits`, adding into the gradient buffers.
    pub fn backward(
        &mut self,
        dev: &Device,
        ops: &dyn Ops,
        saved: Saved,
        dlogits: DeviceBuffer<f32>,
        rows: usize,
    ) -> Result<(), Error> {
        let mut inputs = saved.inputs;
        let mut dz = dlogits;
        for l in (0..self.weights.len()).rev() {
            let (i, o) = (self.dims[l], self.dims[l + 1]);
            let a = inputs
                .pop()
                .ok_or_else(|| Error::InvalidArgument("missing activation".into()))?;
            // dW += aᵀ·dz, db += Σ dz
            ops.gemm(&a, true, &dz, false, &mut self.grad_w[l], i, o, rows, 1.0)?;
            ops.bias_grad(&dz, &mut self.grad_b[l], o)?;
            if l > 0 {
                let mut da = dev.alloc::<f32>(rows * i)?;
                ops.gemm(&dz, false, &self.weights[l], true, &mut da, rows, i, o, 0.0)?;
                ops.relu_grad(&mut da, &a)?;
                dz = da;
            }
        }
        Ok(())
    }

    pub fn zero_grads(&mut self, ops: &dyn Ops) -> Result<(), Error> {
        for g in self.grad_w.iter_mut().chain(self.grad_b.iter_mut()) {
            ops.zero(g)?;
        }
        Ok(())
    }

    pub fn sgd(&mut self, ops: &dyn Ops, lr: f32) -> Result<(), Error> {
        for (w, g) in self.weights.iter_mut().zip(&self.grad_w) {
            ops.sgd(w, g, lr)?;
        }
        for (b, g) in self.biases.iter_mut().zip(&self.grad_b) {
            ops.sgd(b, g, lr)?;
        }
        Ok(())
    }

    /// All parameters, copied to the host (for comparing runs).
    pub fn parameters(&self) -> Result<Vec<f32>, Error> {
        let mut out = Vec::new();
        for b in self.weights.iter().chain(&self.biases) {
            out.extend(b.to_vec()?);
        }
        Ok(out)
    }
}
