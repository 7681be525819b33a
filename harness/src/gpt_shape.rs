//! The shape of the GPT examples' model ([`GptShape`]), written once for tch_gpt and
//! candle_gpt: its sizes, GPT-2 small and a tiny one for CPU tests, the check that a shape can be
//! built, and its parameter count.
//!
//! The fields are `i64`: the type of the command line's `--layers`, `--width`, … ([`ModelArgs`])
//! and of the output lines' integers, so that a negative size reaches [`GptShape::check`] and
//! gets its error. A framework that sizes tensors in `usize` converts at its use sites.
//!
//! [`ModelArgs`]: crate::args::ModelArgs

/// A GPT-2-shaped decoder's sizes: token and position embeddings, `layers` pre-norm blocks of
/// causal self-attention and a 4 × `width` MLP, a final norm, and an output head tied to the
/// token embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptShape {
    /// Transformer blocks.
    pub layers: i64,
    /// Model width.
    pub width: i64,
    /// Attention heads (`width` is a multiple of it).
    pub heads: i64,
    /// Vocabulary size.
    pub vocab: i64,
    /// Context length: the positions the model has, and the length of a training row.
    pub seq: i64,
}

impl GptShape {
    /// GPT-2 small with a context of `seq`: 12 layers, width 768, 12 heads, vocabulary 50,257
    /// (124,439,808 parameters with the tied head at GPT-2's context, 1024).
    pub fn gpt2_small(seq: i64) -> Self {
        Self {
            layers: 12,
            width: 768,
            heads: 12,
            vocab: 50_257,
            seq,
        }
    }

    /// A model small enough for a CPU test in a second: 2 layers, width 32, 2 heads,
    /// vocabulary 64, context 16.
    pub fn tiny() -> Self {
        Self {
            layers: 2,
            width: 32,
            heads: 2,
            vocab: 64,
            seq: 16,
        }
    }

    /// A clear error when the shape cannot be built: a size below 1 (vocabulary below 2), or a
    /// width that is not a multiple of the heads.
    pub fn check(&self) -> Result<(), String> {
        if self.layers < 1 || self.width < 1 || self.heads < 1 || self.vocab < 2 || self.seq < 1 {
            return Err(format!(
                "model shape {self:?}: layers, width, heads and seq must be at least 1, vocab at least 2"
            ));
        }
        if self.width % self.heads != 0 {
            return Err(format!(
                "width {} is not a multiple of heads {}",
                self.width, self.heads
            ));
        }
        if self.checked_parameters().is_none() {
            return Err(format!(
                "model shape {self:?}: its parameter count does not fit in 64 bits"
            ));
        }
        Ok(())
    }

    /// The number of parameters (elements) of the model, the output head tied to the token
    /// embedding (so counted once); `i64::MAX` for a shape whose count does not fit in 64 bits
    /// (which [`GptShape::check`] refuses).
    pub fn parameters(&self) -> i64 {
        self.checked_parameters().unwrap_or(i64::MAX)
    }

    /// [`GptShape::parameters`], `None` where it does not fit in an `i64`.
    fn checked_parameters(&self) -> Option<i64> {
        let w = self.width;
        let ww = w.checked_mul(w)?;
        let per = |k: i64, bias: i64| ww.checked_mul(k)?.checked_add(bias.checked_mul(w)?);
        // two layer norms, qkv, the attention projection, the MLP's two linears
        let block = [per(0, 4)?, per(3, 3)?, per(1, 1)?, per(4, 4)?, per(4, 1)?]
            .into_iter()
            .try_fold(0i64, i64::checked_add)?;
        [
            self.vocab.checked_mul(w)?,
            self.seq.checked_mul(w)?,
            self.layers.checked_mul(block)?,
            w.checked_mul(2)?, // the final norm
        ]
        .into_iter()
        .try_fold(0i64, i64::checked_add)
    }
}

#[cfg(test)]
mod tests {
    use super::GptShape;

    #[test]
    fn gpt2_small_has_gpt2s_parameter_count() {
        assert_eq!(GptShape::gpt2_small(1024).parameters(), 124_439_808);
        // The context only adds position embeddings: 512 fewer positions of width 768.
        assert_eq!(
            GptShape::gpt2_small(512).parameters(),
            124_439_808 - 512 * 768
        );
    }

    #[test]
    fn tiny_parameters_are_counted_by_hand() {
        // Embeddings 64·32 + 16·32; per block 2 norms (128), qkv 3·32·32 + 96, projection
        // 32·32 + 32, MLP 4·32·32 + 128 and 4·32·32 + 32; the final norm 64.
        let block = 128 + (3072 + 96) + (1024 + 32) + (4096 + 128) + (4096 + 32);
        assert_eq!(
            GptShape::tiny().parameters(),
            64 * 32 + 16 * 32 + 2 * block + 64
        );
    }

    #[test]
    fn good_shapes_pass_the_check() {
        GptShape::tiny().check().unwrap();
        GptShape::gpt2_small(1024).check().unwrap();
        GptShape::gpt2_small(512).check().unwrap();
        let smallest = GptShape {
            layers: 1,
            width: 1,
            heads: 1,
            vocab: 2,
            seq: 1,
        };
        smallest.check().unwrap();
    }

    #[test]
    fn sizes_below_their_minimum_are_errors() {
        let tiny = GptShape::tiny();
        let bad = [
            GptShape { layers: 0, ..tiny },
            GptShape { width: 0, ..tiny },
            GptShape { heads: -2, ..tiny },
            GptShape { vocab: 1, ..tiny },
            GptShape { seq: 0, ..tiny },
        ];
        let rule = "layers, width, heads and seq must be at least 1, vocab at least 2";
        for shape in bad {
            let want = format!("model shape {shape:?}: {rule}");
            assert_eq!(shape.check(), Err(want));
        }
    }

    #[test]
    fn a_shape_whose_parameter_count_overflows_is_an_error_not_a_panic() {
        for shape in [
            GptShape {
                width: 4_000_000_000,
                heads: 1,
                ..GptShape::tiny()
            },
            GptShape {
                vocab: i64::MAX,
                ..GptShape::tiny()
            },
            GptShape {
                layers: i64::MAX / 2,
                ..GptShape::tiny()
            },
        ] {
            let e = shape.check().unwrap_err();
            assert!(e.contains("does not fit in 64 bits"), "{e}");
            assert_eq!(shape.parameters(), i64::MAX);
        }
    }

    #[test]
    fn a_width_that_the_heads_do_not_divide_is_an_error() {
        let bad = GptShape {
            heads: 3,
            ..GptShape::tiny()
        };
        let want = "width 32 is not a multiple of heads 3";
        assert_eq!(bad.check(), Err(want.to_string()));
    }
}
