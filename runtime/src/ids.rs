//! Newtypes for ids and quantities, so a function never takes three bare `usize`s.
use std::fmt;

macro_rules! newtype {
    ($(#[$m:meta])* $name:ident($inner:ty)) => {
        $(#[$m])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub $inner);
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

newtype!(
    /// An adapter registered with the engine (stable for its lifetime; see [`Generation`]).
    AdapterId(u32)
);
newtype!(
    /// Bumped each time an adapter name is (re)loaded; caches key by (id, generation).
    Generation(u32)
);
newtype!(
    /// One sequence (one request's generation stream) inside the engine.
    SeqId(u64)
);
newtype!(
    /// A LoRA rank.
    Rank(usize)
);
newtype!(
    /// A transformer layer index.
    LayerIdx(usize)
);
newtype!(
    /// A physical KV-cache block.
    BlockIdx(u32)
);
