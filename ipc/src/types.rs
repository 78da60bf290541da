//! Small newtypes shared by the layouts. All `#[repr(transparent)]`/`#[repr(C)]` and `Pod`
//! where they are stored in shared memory.

use bytemuck::{Pod, Zeroable};

/// Identifies an adapter (assigned by the runtime; stable across generations).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct AdapterId(pub u64);

/// Reloading an adapter under the same id makes a new generation.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct Generation(pub u64);

/// A transformer layer index.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct LayerIdx(pub u32);

/// A CPU LoRA worker's slot in the exchange (0..max_workers).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct WorkerId(pub u32);

/// A host-store reader slot: the engine process and each worker use a distinct one, so the
/// engine can drop the leases of a worker that died ([`crate::HostStore::release_reader`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ReaderSlot(pub u32);

/// A step sequence number. 32 bits so it can be a futex word and the target of
/// `cuStreamWaitValue32`; compared with wrap-around ([`StepSeq::reached`]). 0 means "no step
/// yet".
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct StepSeq(pub u32);

impl StepSeq {
    /// The sequence number after this one (skipping 0 on wrap-around).
    pub fn next(self) -> Self {
        match self.0.wrapping_add(1) {
            0 => StepSeq(1),
            n => StepSeq(n),
        }
    }

    /// Whether `self` is at or after `target`, with wrap-around (window of 2^31 steps).
    pub fn reached(self, target: StepSeq) -> bool {
        (self.0.wrapping_sub(target.0) as i32) >= 0
    }
}

/// A LoRA-targeted projection. The index is the module's place in layouts.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Module {
    /// Attention query projection.
    Q = 0,
    /// Attention key projection.
    K = 1,
    /// Attention value projection.
    V = 2,
    /// Attention output projection.
    O = 3,
    /// MLP gate projection.
    Gate = 4,
    /// MLP up projection.
    Up = 5,
    /// MLP down projection.
    Down = 6,
}

/// Number of [`Module`]s.
pub const NUM_MODULES: usize = 7;

impl Module {
    /// All modules in index order.
    pub const ALL: [Module; NUM_MODULES] = [
        Module::Q,
        Module::K,
        Module::V,
        Module::O,
        Module::Gate,
        Module::Up,
        Module::Down,
    ];

    /// Index 0..7 (q,k,v,o,gate,up,down).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The module with index `i`, if any.
    pub fn from_index(i: usize) -> Option<Self> {
        Self::ALL.get(i).copied()
    }
}

/// A set of modules as a bitmask (bit i = module index i).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct ModuleMask(pub u32);

impl ModuleMask {
    /// The empty set.
    pub const EMPTY: Self = ModuleMask(0);

    /// This set plus `m`.
    pub fn with(self, m: Module) -> Self {
        ModuleMask(self.0 | (1 << m.index()))
    }

    /// Whether `m` is in the set.
    pub fn contains(self, m: Module) -> bool {
        self.0 & (1 << m.index()) != 0
    }

    /// The modules in the set, in index order (bits above 6 are ignored).
    pub fn iter(self) -> impl Iterator<Item = Module> {
        Module::ALL.into_iter().filter(move |m| self.contains(*m))
    }
}

impl FromIterator<Module> for ModuleMask {
    fn from_iter<I: IntoIterator<Item = Module>>(iter: I) -> Self {
        iter.into_iter().fold(Self::EMPTY, Self::with)
    }
}

/// Storage dtype of adapter weights.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE f32.
    F32 = 0,
    /// IEEE f16 (`half::f16`).
    F16 = 1,
    /// bfloat16 (`half::bf16`).
    BF16 = 2,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The code stored in shared memory.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Decodes a stored code.
    pub fn from_code(c: u32) -> Option<Self> {
        match c {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// A reference to one adapter in the host store: index slot plus identity. Stored in the
/// exchange's job table; a stale handle (slot reused by another adapter) simply fails to
/// resolve.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct AdapterHandle {
    /// Adapter id.
    pub id: AdapterId,
    /// Generation.
    pub generation: Generation,
    /// Index slot in the host store.
    pub slot: u32,
    /// Zero.
    pub _pad: u32,
}

/// A set of workers as a bitmask (bit i = worker i); at most 64 workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WorkerMask(pub u64);

impl WorkerMask {
    /// Workers `0..n`.
    pub fn first(n: u32) -> Self {
        WorkerMask(if n >= 64 { u64::MAX } else { (1u64 << n) - 1 })
    }

    /// Whether worker `w` is in the set.
    pub fn contains(self, w: WorkerId) -> bool {
        w.0 < 64 && self.0 & (1 << w.0) != 0
    }

    /// This set plus `w`.
    pub fn with(self, w: WorkerId) -> Self {
        WorkerMask(self.0 | (1 << w.0))
    }

    /// This set minus `w`.
    pub fn without(self, w: WorkerId) -> Self {
        WorkerMask(self.0 & !(1 << w.0))
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The workers in the set, ascending.
    pub fn iter(self) -> impl Iterator<Item = WorkerId> {
        (0..64u32)
            .filter(move |i| self.0 & (1 << i) != 0)
            .map(WorkerId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_wraps() {
        assert!(StepSeq(5).reached(StepSeq(5)));
        assert!(StepSeq(6).reached(StepSeq(5)));
        assert!(!StepSeq(4).reached(StepSeq(5)));
        assert!(StepSeq(2).reached(StepSeq(u32::MAX - 1)));
        assert_eq!(StepSeq(u32::MAX).next(), StepSeq(1));
    }

    #[test]
    fn masks() {
        let m: ModuleMask = [Module::Q, Module::Down].into_iter().collect();
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![Module::Q, Module::Down]);
        let w = WorkerMask::first(3).without(WorkerId(1));
        assert_eq!(w.iter().collect::<Vec<_>>(), vec![WorkerId(0), WorkerId(2)]);
    }
}
