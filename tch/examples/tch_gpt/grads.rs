//! The check that a model trains at all: after one backward, every trainable variable of the
//! `VarStore` has a defined, finite, non-zero gradient. Shared by the example's `grads` phase
//! and `tests/tch_gpt_model.rs`.

use tch::{nn, TchError};

/// What one backward left on the trainable variables, by name (sorted).
#[derive(Debug, Default)]
pub struct GradCheck {
    /// Trainable variables looked at.
    pub trainable: usize,
    /// Their elements.
    pub elements: i64,
    /// Variables whose gradient is undefined (the graph does not reach them).
    pub missing: Vec<String>,
    /// Variables whose gradient is exactly zero everywhere.
    pub zero: Vec<String>,
    /// Variables whose gradient holds a NaN or an infinity.
    pub non_finite: Vec<String>,
}

impl GradCheck {
    /// True when every trainable variable has a finite, non-zero gradient.
    pub fn passed(&self) -> bool {
        self.trainable > 0
            && self.missing.is_empty()
            && self.zero.is_empty()
            && self.non_finite.is_empty()
    }
}

/// Looks at the gradient of every trainable variable of `vs` (call after `backward`).
pub fn check_gradients(vs: &nn::VarStore) -> Result<GradCheck, TchError> {
    let mut vars: Vec<_> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut c = GradCheck::default();
    for (name, var) in vars {
        if !var.requires_grad() {
            continue;
        }
        c.trainable += 1;
        c.elements += var.numel() as i64;
        let g = var.f_grad()?;
        if !g.defined() {
            c.missing.push(name);
            continue;
        }
        let finite = g.f_isfinite()?.f_all()?.f_int64_value(&[])? != 0;
        if !finite {
            c.non_finite.push(name);
        } else if g.f_abs()?.f_max()?.f_double_value(&[])? == 0.0 {
            c.zero.push(name);
        }
    }
    Ok(c)
}
