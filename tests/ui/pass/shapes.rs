//! Every function shape the attributes support compiles: free fns, methods with `&self` and
//! `&mut self`, generics with where-clauses, `impl Trait` arguments and returns, async fns, and
//! the attributes stacked in any order.
use oomguard::{leak_check, memory_budget, no_grad, oom_retry, BatchPlan, Error};

#[oom_retry(batch = rows)]
fn free_fn(rows: usize, data: Vec<f32>, scale: &f32, out: &mut Vec<f32>) -> Result<usize, Error> {
    out.push(data.len() as f32 * scale);
    if rows > 4 {
        return Ok(rows);
    }
    Ok(rows * 2)
}

#[oom_retry(plan = plan, max_retries = 3, min = 1, remember = false)]
fn with_plan(plan: &BatchPlan) -> Result<usize, Error> {
    Ok(plan.chunks().len())
}

struct Trainer {
    steps: u32,
}

impl Trainer {
    #[oom_retry]
    #[no_grad]
    fn eval(&self, x: u32) -> Result<u32, Error> {
        Ok(self.steps + x)
    }

    #[memory_budget("64 MiB")]
    #[oom_retry(batch = n)]
    #[leak_check(action = error, allow = "1 KiB")]
    fn train(&mut self, n: u32) -> Result<u32, Error> {
        self.steps += 1;
        Ok(n)
    }
}

#[oom_retry]
fn generic<T: Clone + std::fmt::Debug, I>(items: I, t: T) -> Result<Vec<T>, Error>
where
    I: IntoIterator<Item = T> + Clone,
{
    let mut v: Vec<T> = items.into_iter().collect();
    v.push(t);
    Ok(v)
}

#[oom_retry]
#[memory_budget(fraction = 0.5)]
fn impl_trait(xs: impl Iterator<Item = u32> + Clone) -> Result<impl std::fmt::Debug, Error> {
    Ok(xs.sum::<u32>())
}

#[no_grad]
#[memory_budget(bytes = 1 << 20)]
#[leak_check(action = warn)]
fn guarded(x: u32) -> u32 {
    assert!(!oomguard::is_grad_enabled());
    x + 1
}

#[no_grad]
async fn async_guarded(x: u32) -> Result<u32, Error> {
    Ok(x)
}

#[oom_retry(batch = rows)]
#[no_grad]
async fn async_retry(rows: u64) -> Result<u64, Error> {
    Ok(rows)
}

fn main() {
    let mut out = Vec::new();
    assert_eq!(free_fn(8, vec![1.0], &2.0, &mut out).unwrap(), 8);
    assert_eq!(with_plan(&BatchPlan::whole(10).unwrap()).unwrap(), 1);
    let mut t = Trainer { steps: 0 };
    assert_eq!(t.eval(1).unwrap(), 1);
    assert_eq!(t.train(3).unwrap(), 3);
    assert_eq!(generic(vec![1, 2], 3).unwrap(), vec![1, 2, 3]);
    let _ = impl_trait([1u32, 2].into_iter()).unwrap();
    assert_eq!(guarded(1), 2);
    let _ = async_guarded(1);
    let _ = async_retry(1);
}
