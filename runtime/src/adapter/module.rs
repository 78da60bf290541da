//! The seven projections of a Llama-family layer that a LoRA adapter can target.

/// A LoRA-targetable projection, in HF naming order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraModule {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraModule {
    pub const ALL: [LoraModule; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// Position in [`ALL`](Self::ALL), for per-module arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The HF module name, e.g. `q_proj`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The HF parent module: `self_attn` or `mlp`.
    pub fn parent(self) -> &'static str {
        match self {
            Self::Q | Self::K | Self::V | Self::O => "self_attn",
            Self::Gate | Self::Up | Self::Down => "mlp",
        }
    }

    pub fn from_hf_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.hf_name() == s)
    }

    /// The module's name relative to the `*ForCausalLM` model, as PEFT matches it:
    /// `model.layers.{layer}.self_attn.q_proj`.
    pub fn module_path(self, layer: usize) -> String {
        format!("model.layers.{layer}.{}.{}", self.parent(), self.hf_name())
    }
}

impl std::fmt::Display for LoraModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hf_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_index_matches_order() {
        for (i, m) in LoraModule::ALL.into_iter().enumerate() {
            assert_eq!(m.index(), i);
            assert_eq!(LoraModule::from_hf_name(m.hf_name()), Some(m));
        }
        assert_eq!(LoraModule::from_hf_name("lm_head"), None);
        assert_eq!(LoraModule::Down.parent(), "mlp");
        assert_eq!(
            LoraModule::O.module_path(3),
            "model.layers.3.self_attn.o_proj"
        );
    }
}
