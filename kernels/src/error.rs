//! The errors the kernels can report. Shape mismatches inside the engine are bugs and panic with a
//! clear message; these are the failures that come from data (weights, configs) a caller loaded.

use thiserror::Error;

/// A failure of a fallible kernel helper.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KernelError {
    /// A byte buffer does not hold exactly the number of elements the destination expects.
    #[error(
        "{format} buffer has {got} bytes but {expected} were expected \
         ({elements} elements of {elem_bytes} bytes); check the tensor's dtype and shape"
    )]
    ByteLength {
        /// Name of the element format, e.g. `bf16`.
        format: &'static str,
        /// Number of destination elements.
        elements: usize,
        /// Bytes per source element.
        elem_bytes: usize,
        /// `elements * elem_bytes`.
        expected: usize,
        /// Bytes actually given.
        got: usize,
    },
    /// A quantised buffer whose element count is not a whole number of blocks.
    #[error(
        "{format} stores blocks of {block} values but {values} values were asked for; \
         quantised rows must be a multiple of the block size"
    )]
    PartialBlock {
        format: &'static str,
        values: usize,
        block: usize,
    },
    /// Quantising into a format Thaw only reads.
    #[error("Thaw cannot quantise to {format}; produce it with llama.cpp's `llama-quantize`")]
    QuantizeUnsupported { format: &'static str },
    /// RoPE parameters that cannot produce a frequency table.
    #[error("invalid RoPE configuration: {0}")]
    InvalidRope(String),
}
