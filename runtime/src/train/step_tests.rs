//! The generic skeleton over a toy framework: rows of `f64`, each chunk charging a simulated
//! card 1 MiB per row, the "gradient" the sum of the rows, the "update" recorded.

use super::*;
use crate::retry::{inference_policy, Chunk, FinderOptions, RetryEngine};
use crate::{ByteSize, Device, DeviceBuffer, Error};

struct Toy<'d> {
    card: &'d Device,
    updates: Vec<f64>,
    discarded: usize,
    losses: usize,
    /// The chunk loss that panics (not an out-of-memory), counting from 1.
    panic_at: Option<usize>,
}

impl TrainFramework for Toy<'_> {
    type Error = Error;
    type Batch = [f64];
    type Loss = (f64, DeviceBuffer<u8>);
    type Accumulator = (LossSum, f64);
    type Grads = f64;

    fn batch_rows(&self, batch: &[f64]) -> Result<Option<usize>, String> {
        Ok(Some(batch.len()))
    }
    fn chunk_loss(&mut self, batch: &[f64], chunk: &Chunk) -> Result<Self::Loss, Error> {
        self.losses += 1;
        assert_ne!(
            Some(self.losses),
            self.panic_at,
            "a user's assertion in the loss"
        );
        let rows = &batch[chunk.rows()];
        let mean = rows.iter().sum::<f64>() / rows.len() as f64;
        Ok((mean, self.card.alloc::<u8>(chunk.len() << 20)?))
    }
    fn accumulator(&mut self) -> Result<Self::Accumulator, Error> {
        Ok((LossSum::new(), 0.0))
    }
    fn backward(
        &self,
        acc: &mut Self::Accumulator,
        loss: Self::Loss,
        c: &Chunk,
    ) -> Result<(), Error> {
        acc.0.admit(c).map_err(Error::InvalidArgument)?;
        acc.0.add_mean(c, loss.0);
        acc.1 += loss.0 * c.weight();
        // the chunk's "activations" go with its backward, as a graph's do
        drop(loss.1);
        Ok(())
    }
    fn gradients(&self, acc: Self::Accumulator) -> Result<Gradients<f64>, Error> {
        acc.0.covers_batch().map_err(Error::InvalidArgument)?;
        Ok(Gradients {
            grads: acc.1,
            loss: acc.0.loss(),
            rows: acc.0.rows(),
        })
    }
    fn batch_error(message: String) -> Error {
        Error::InvalidArgument(message)
    }
    fn discard_gradients(&mut self) {
        self.discarded += 1;
    }
}

impl<'d> Toy<'d> {
    /// A toy that has run nothing, charging `card`.
    fn on(card: &'d Device) -> Self {
        Toy {
            card,
            updates: Vec::new(),
            discarded: 0,
            losses: 0,
            panic_at: None,
        }
    }
}

impl TrainUpdate for Toy<'_> {
    type Updated = usize;
    fn update(&mut self, grads: f64) -> Result<usize, Error> {
        self.updates.push(grads);
        Ok(self.updates.len())
    }
}

#[test]
fn an_out_of_memory_splits_the_batch_and_updates_once_on_every_row() {
    let card = Device::sim(ByteSize::mib(6));
    let mut toy = Toy::on(&card);
    let batch: Vec<f64> = (1..=8).map(f64::from).collect();
    let done = train_step(&RetryEngine::new(), &card, &mut toy, &batch[..]).unwrap();
    assert_eq!(done.step.rows, 8);
    assert!(done.step.report.retries() >= 1, "8 MiB cannot fit in 6");
    assert!((done.step.loss - 4.5).abs() < 1e-12, "{}", done.step.loss);
    assert_eq!(done.updated, 1);
    assert_eq!(toy.updates.len(), 1, "one update per step");
    assert!((toy.updates[0] - 4.5).abs() < 1e-12);
    assert_eq!(
        toy.discarded,
        done.step.report.retries(),
        "one discard per failed attempt"
    );
}

#[test]
fn a_policy_that_drops_rows_is_refused_before_anything_runs() {
    let card = Device::sim(ByteSize::mib(6));
    let mut toy = Toy::on(&card);
    let engine = RetryEngine::new().with_policy(inference_policy());
    let err = train_step(&engine, &card, &mut toy, &[1.0; 8][..]).unwrap_err();
    assert!(
        matches!(err, TrainStepError::PolicyDropsRows { batch: 8, .. }),
        "{err}"
    );
    assert!(toy.updates.is_empty());
    assert_eq!(toy.losses, 0, "no chunk ran");
}

#[test]
fn the_finder_measures_the_attempt_and_updates_nothing() {
    let card = Device::sim(ByteSize::mib(64));
    let mut toy = Toy::on(&card);
    let found = find_max_batch_train(
        &card,
        FinderOptions::default(),
        &mut toy,
        |rows| Ok::<_, Error>(vec![1.0; rows]),
        Some(8),
    )
    .unwrap();
    assert!((56..=64).contains(&found.max_batch), "{found}");
    assert_eq!(found.accumulation_bytes, Some(8));
    assert!(toy.updates.is_empty());
    assert_eq!(
        toy.discarded as u64,
        found.step_runs() as u64,
        "a discard after every run"
    );
}

/// A panic that is not an out-of-memory, in the second chunk of a split attempt, after the first
/// chunk's backward: the gradients are discarded as after any failure (they stayed, and a loop
/// that caught the panic and stepped would apply half a batch).
#[test]
fn a_panic_in_an_attempt_discards_its_gradients() {
    let card = Device::sim(ByteSize::mib(6));
    let mut toy = Toy::on(&card);
    let batch: Vec<f64> = (1..=8).map(f64::from).collect();
    // the whole batch fails (8 MiB in 6), then 2 × 4: its second chunk panics
    toy.panic_at = Some(3);
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train_step(&RetryEngine::new(), &card, &mut toy, &batch[..])
    }));
    assert!(out.is_err(), "the panic goes on");
    assert_eq!(toy.losses, 3);
    assert_eq!(
        toy.discarded, 2,
        "after the failed attempt, and after the panic"
    );
    assert!(toy.updates.is_empty());
}
