//! The variables a training step updates, and those it deliberately leaves alone.

use std::collections::HashSet;
use std::fmt::Write as _;

use candle_core::{TensorId, Var};
use candle_nn::VarMap;

/// One variable, with its name where one is known (from a [`VarMap`]).
#[derive(Clone, Debug)]
pub(crate) struct Param {
    pub(crate) var: Var,
    pub(crate) name: Option<String>,
}

impl Param {
    /// `#index `name` [shape] dtype`: enough to find the variable in the model.
    pub(crate) fn describe(&self, index: usize) -> String {
        let mut s = format!("#{index}");
        if let Some(n) = &self.name {
            let _ = write!(s, " `{n}`");
        }
        let _ = write!(s, " {:?} {:?}", self.var.dims(), self.var.dtype());
        s
    }
}

/// The parameters of a training step: the variables it trains, each of which must receive a
/// gradient in every step (an error names any that does not), and the variables it leaves
/// alone on purpose ([`Params::freeze`]).
///
/// A float variable the loss depends on that is in neither list is an error too: the optimizer
/// would never see its gradient, so it would stay frozen without anyone having decided so.
/// Pass every variable the optimizer updates (what you gave it, or [`Params::from_varmap`] of
/// the model's [`VarMap`]).
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use oomguard_candle::Params;
///
/// let w = Var::zeros(4, DType::F32, &Device::Cpu)?;
/// let emb = Var::zeros((10, 4), DType::F32, &Device::Cpu)?;
/// // train `w`; `emb` is a pretrained embedding kept as it is
/// let params = Params::new(&[w.clone(), emb.clone()]).freeze(&[emb]);
/// assert_eq!(params.trained_vars().len(), 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Params {
    pub(crate) trained: Vec<Param>,
    pub(crate) frozen: Vec<Param>,
}

impl Params {
    /// Bytes of the trained variables: what one set of their gradients takes.
    pub(crate) fn trained_bytes(&self) -> u64 {
        self.trained
            .iter()
            .map(|p| (p.var.elem_count() * p.var.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// `vars`, all trained (a variable listed twice counts once).
    pub fn new(vars: &[Var]) -> Self {
        let mut p = Self::default();
        for v in vars {
            p.push(v.clone(), None);
        }
        p
    }

    /// Every variable of `varmap`, all trained, in the order of their names (which error
    /// messages then quote).
    pub fn from_varmap(varmap: &VarMap) -> Self {
        // A poisoned lock still holds a valid map: the names and variables are only read here.
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        let mut named: Vec<(&String, &Var)> = data.iter().collect();
        named.sort_by(|a, b| a.0.cmp(b.0));
        let mut p = Self::default();
        for (name, v) in named {
            p.push(v.clone(), Some(name.clone()));
        }
        p
    }

    fn push(&mut self, var: Var, name: Option<String>) {
        if !self.contains(var.id()) {
            self.trained.push(Param { var, name });
        }
    }

    fn contains(&self, id: TensorId) -> bool {
        self.trained
            .iter()
            .chain(&self.frozen)
            .any(|p| p.var.id() == id)
    }

    /// Freezes `vars`: the step never updates them (any gradient they receive is dropped, so
    /// candle's optimizers skip them) and does not require a gradient for them. A frozen
    /// variable listed among the trained ones leaves them.
    pub fn freeze(mut self, vars: &[Var]) -> Self {
        for v in vars {
            match self.trained.iter().position(|p| p.var.id() == v.id()) {
                Some(i) => {
                    let p = self.trained.remove(i);
                    self.frozen.push(p);
                }
                None if !self.contains(v.id()) => self.frozen.push(Param {
                    var: v.clone(),
                    name: None,
                }),
                None => {}
            }
        }
        self
    }

    /// The trained variables, in order (e.g. for the optimizer: `SGD::new(params.trained_vars(), lr)`).
    pub fn trained_vars(&self) -> Vec<Var> {
        self.trained.iter().map(|p| p.var.clone()).collect()
    }

    /// The frozen variables.
    pub fn frozen_vars(&self) -> Vec<Var> {
        self.frozen.iter().map(|p| p.var.clone()).collect()
    }

    /// The ids of every listed variable, trained or frozen.
    pub(crate) fn known_ids(&self) -> HashSet<TensorId> {
        self.trained
            .iter()
            .chain(&self.frozen)
            .map(|p| p.var.id())
            .collect()
    }
}

impl From<&[Var]> for Params {
    fn from(vars: &[Var]) -> Self {
        Self::new(vars)
    }
}

impl From<&Vec<Var>> for Params {
    fn from(vars: &Vec<Var>) -> Self {
        Self::new(vars)
    }
}

impl From<Vec<Var>> for Params {
    fn from(vars: Vec<Var>) -> Self {
        Self::new(&vars)
    }
}

impl<const N: usize> From<&[Var; N]> for Params {
    fn from(vars: &[Var; N]) -> Self {
        Self::new(vars)
    }
}

impl From<&Var> for Params {
    fn from(var: &Var) -> Self {
        Self::new(std::slice::from_ref(var))
    }
}

impl From<&VarMap> for Params {
    fn from(varmap: &VarMap) -> Self {
        Self::from_varmap(varmap)
    }
}

impl From<&Params> for Params {
    fn from(p: &Params) -> Self {
        p.clone()
    }
}
