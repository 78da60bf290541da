//! The device budget (KV and adapters together) on a real GPU, with vLLM's meaning of
//! `--gpu-memory-utilization`: the server may use `utilization × total device memory`; what the
//! model's weights and a forward pass at the largest batch (activations, workspaces) take comes
//! off that, and the rest is the paged pool. vLLM measures the second part by profiling one
//! forward pass; the engine loop does the same (an engine with a minimal KV cache runs one
//! step of `--max-num-batched-tokens` tokens) and passes the measured bytes here.
//!
//! Like vLLM, start-up fails when other processes hold so much of the device that the share
//! asked for is not free, rather than silently serving with less.

/// Free and total bytes of the device, as the driver reports them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: u64,
    pub total: u64,
}

/// Why no budget could be sized; each says what to change.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BudgetError {
    #[error("--gpu-memory-utilization {0} must be above 0 and at most 1")]
    Utilization(f64),
    #[error(
        "the device has {free} of its {total} bytes free at start-up, less than \
         --gpu-memory-utilization {utilization} asks for ({requested} bytes); other processes \
         are using it: free the device or lower --gpu-memory-utilization"
    )]
    NotFree {
        free: u64,
        total: u64,
        utilization: f64,
        requested: u64,
    },
    #[error(
        "the model's weights and a forward pass take {used} bytes, leaving {left} of the \
         {requested} bytes --gpu-memory-utilization {utilization} allows for the KV cache and \
         adapters, below the {need} one sequence needs; raise --gpu-memory-utilization, lower \
         --max-num-batched-tokens or --max-model-len, or use a smaller model"
    )]
    TooSmall {
        used: u64,
        left: u64,
        requested: u64,
        utilization: f64,
        need: u64,
    },
}

/// Bytes of one page of the device budget: one KV block (`block_size` tokens) of every layer,
/// K and V, in `kv_elem_bytes` a value: the backend's ([`Backend::kv_elem_bytes`]: f32 on the
/// CPU, the bf16 KV cache on CUDA), so a page is what the KV cache really allocates per block.
///
/// [`Backend::kv_elem_bytes`]: thaw_runtime::backend::Backend::kv_elem_bytes
pub fn kv_page_bytes(
    c: &thaw_runtime::model::ModelConfig,
    block_size: usize,
    kv_elem_bytes: usize,
) -> u64 {
    let values = c.num_layers * 2 * c.num_kv_heads * c.head_dim * block_size;
    (values as u64 * kv_elem_bytes as u64).max(1)
}

/// Bytes a profile took on the device beyond its own KV cache: what the free memory fell by
/// from `before` to `after`, less the `profile_kv` bytes of KV the profiling engine allocated.
pub fn profiled_bytes(before: DeviceMemory, after: DeviceMemory, profile_kv: u64) -> u64 {
    before
        .free
        .saturating_sub(after.free)
        .saturating_sub(profile_kv)
}

/// Bytes for the KV cache and adapters: `utilization × total − used`, where `used` is what the
/// model and a forward pass take (see [`profiled_bytes`]), `at_start` the device's memory
/// before this process put anything on it, and `min_bytes` what one sequence of
/// `--max-model-len` needs (less is an error, as the CPU backend's budget check).
pub fn kv_adapter_budget(
    utilization: f64,
    at_start: DeviceMemory,
    used: u64,
    min_bytes: u64,
) -> Result<u64, BudgetError> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(BudgetError::Utilization(utilization));
    }
    let requested = (at_start.total as f64 * utilization).floor() as u64;
    if at_start.free < requested {
        return Err(BudgetError::NotFree {
            free: at_start.free,
            total: at_start.total,
            utilization,
            requested,
        });
    }
    let left = requested.saturating_sub(used);
    if left < min_bytes.max(1) {
        return Err(BudgetError::TooSmall {
            used,
            left,
            requested,
            utilization,
            need: min_bytes,
        });
    }
    Ok(left)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    /// A page is one KV block of every layer in the backend's KV element: Llama-2-7B shapes
    /// with 16-token blocks take 8 MiB a page in CUDA's bf16 and 16 MiB in the CPU backend's
    /// f32, and the CPU backend's page is exactly what its KV cache allocates per block.
    #[test]
    fn a_page_is_one_kv_block_in_the_backends_element() {
        use thaw_runtime::backend::{cpu::CpuBackend, Backend};
        let p = crate::gen::preset("llama-7b-shape").unwrap();
        let json = crate::gen::model_config(&p, p.default_dtype).to_string();
        let c = thaw_runtime::model::ModelConfig::from_json(&json).unwrap();
        assert_eq!(kv_page_bytes(&c, 16, 2), 8 << 20);
        assert_eq!(kv_page_bytes(&c, 16, 4), 16 << 20);
        let tiny = crate::gen::preset("tiny").unwrap();
        let json = crate::gen::model_config(&tiny, tiny.default_dtype).to_string();
        let c = thaw_runtime::model::ModelConfig::from_json(&json).unwrap();
        let cpu = CpuBackend::new(&c);
        assert_eq!(cpu.kv_elem_bytes(), 4);
        let layout = thaw_kernels::cpu::KvLayout {
            block_size: 16,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        let blocks = 3;
        let layer = cpu.alloc_kv_layer(layout, blocks).unwrap();
        let allocated = c.num_layers * (layer.k.len() + layer.v.len()) * std::mem::size_of::<f32>();
        assert_eq!(
            allocated as u64,
            blocks as u64 * kv_page_bytes(&c, 16, cpu.kv_elem_bytes())
        );
    }

    /// An 80 GiB device with 79 GiB free (the context's own share taken).
    fn h100() -> DeviceMemory {
        DeviceMemory {
            free: 79 * GIB,
            total: 80 * GIB,
        }
    }

    #[test]
    fn budget_is_the_share_less_weights_and_activations() {
        // Llama-7B in bf16 (~12.6 GiB) and a 2 GiB forward pass at 0.9: 72 - 14.6 GiB.
        let used = 12 * GIB + 600 * (1 << 20) + 2 * GIB;
        let b = kv_adapter_budget(0.9, h100(), used, GIB).unwrap();
        assert_eq!(b, (80.0 * GIB as f64 * 0.9) as u64 - used);
        // All of it at 1.0 needs the whole device free.
        assert!(matches!(
            kv_adapter_budget(1.0, h100(), used, GIB),
            Err(BudgetError::NotFree { .. })
        ));
        let idle = DeviceMemory {
            free: 80 * GIB,
            total: 80 * GIB,
        };
        assert_eq!(
            kv_adapter_budget(1.0, idle, used, GIB).unwrap(),
            80 * GIB - used
        );
    }

    #[test]
    fn refuses_what_cannot_work_and_says_what_to_change() {
        for u in [0.0, -0.1, 1.01, f64::NAN] {
            let e = kv_adapter_budget(u, h100(), 0, 1).unwrap_err();
            assert!(matches!(e, BudgetError::Utilization(_)), "{e:?}");
        }
        // Another process holds half the device.
        let busy = DeviceMemory {
            free: 40 * GIB,
            total: 80 * GIB,
        };
        let e = kv_adapter_budget(0.9, busy, GIB, GIB).unwrap_err();
        assert!(
            e.to_string().contains("lower --gpu-memory-utilization"),
            "{e}"
        );
        // A 70 GiB model at 0.5.
        let e = kv_adapter_budget(0.5, h100(), 70 * GIB, GIB).unwrap_err();
        assert!(matches!(e, BudgetError::TooSmall { left: 0, .. }), "{e:?}");
        assert!(
            e.to_string().contains("raise --gpu-memory-utilization"),
            "{e}"
        );
        // Room, but not for one sequence.
        let e = kv_adapter_budget(0.9, h100(), 72 * GIB - 10, 11).unwrap_err();
        assert!(matches!(
            e,
            BudgetError::TooSmall {
                left: 10,
                need: 11,
                ..
            }
        ));
    }

    #[test]
    fn profile_counts_what_the_engine_took_beyond_its_kv() {
        let before = h100();
        let after = DeviceMemory {
            free: 60 * GIB,
            total: 80 * GIB,
        };
        assert_eq!(profiled_bytes(before, after, GIB), 18 * GIB);
        // Memory freed meanwhile (another process) never gives a negative size.
        assert_eq!(profiled_bytes(after, before, GIB), 0);
    }

    proptest! {
        /// The budget plus what the model uses never exceeds the share asked for, and raising
        /// the utilisation never shrinks it.
        #[test]
        fn budget_stays_inside_the_share(
            total in 1u64..(1 << 40),
            taken in 0.0f64..0.2,
            used in 0u64..(1 << 40),
            u in 0.01f64..1.0,
            du in 0.0f64..0.5,
        ) {
            let at_start = DeviceMemory { free: (total as f64 * (1.0 - taken)) as u64, total };
            if let Ok(b) = kv_adapter_budget(u, at_start, used, 1) {
                prop_assert!(b + used <= (total as f64 * u) as u64);
                let u2 = (u + du).min(1.0);
                match kv_adapter_budget(u2, at_start, used, 1) {
                    Ok(b2) => prop_assert!(b2 >= b),
                    Err(e) => prop_assert!(matches!(e, BudgetError::NotFree { .. }), "{e}"),
                }
            }
        }
    }
}
