//! [`NoCuda`] as a [`Backend`] without the `cuda` feature, so [`super::any::AnyBackend`]'s
//! CUDA variant type-checks: it has no values, so every op is `match *self {}` and is
//! statically unreachable.
use std::ops::Range;
use std::sync::Arc;

use thaw_kernels::cpu::KvLayout;

use super::{Backend, LinearDims, LoraBatch, NoCuda, StepLayout};
use crate::adapter::{LoraAdapter, LoraModule};
use crate::error::Result;
use crate::ids::LayerIdx;

impl Backend for NoCuda {
    type Buf = NoCuda;
    type Linear = NoCuda;
    type Vector = NoCuda;
    type Lora = NoCuda;
    type KvLayer = NoCuda;

    fn name(&self) -> &'static str {
        match *self {}
    }
    fn alloc(&self, _: usize) -> Result<NoCuda> {
        match *self {}
    }
    fn upload_linear(
        &self,
        _: Vec<f32>,
        _: usize,
        _: usize,
        _: Option<Vec<f32>>,
    ) -> Result<NoCuda> {
        match *self {}
    }
    fn upload_vector(&self, _: Vec<f32>) -> Result<NoCuda> {
        match *self {}
    }
    fn upload_lora(&self, _: Arc<LoraAdapter>) -> Result<NoCuda> {
        match *self {}
    }
    fn stream_lora(&mut self, _: Arc<LoraAdapter>) -> Result<NoCuda> {
        match *self {}
    }
    fn landed_layers(&self, _: &NoCuda) -> usize {
        match *self {}
    }
    fn lora_failure(&self, _: &NoCuda) -> Option<String> {
        match *self {}
    }
    fn kv_elem_bytes(&self) -> usize {
        match *self {}
    }
    fn alloc_kv_layer(&self, _: KvLayout, _: usize) -> Result<NoCuda> {
        match *self {}
    }
    fn embed(&mut self, _: &NoCuda, _: &[u32], _: &mut NoCuda) {
        match *self {}
    }
    fn rms_norm(&mut self, _: &NoCuda, _: &NoCuda, _: f32, _: usize, _: &mut NoCuda) {
        match *self {}
    }
    fn residual_norm(&mut self, _: &NoCuda, _: &NoCuda, _: f32, _: usize, _: &mut NoCuda) {
        match *self {}
    }
    fn residual_add(&mut self, _: &mut NoCuda, _: &NoCuda, _: usize) {
        match *self {}
    }
    fn gather_residual(&mut self, _: &NoCuda, _: usize, _: &[usize], _: &mut NoCuda) {
        match *self {}
    }
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &mut self,
        _: &mut NoCuda,
        _: &NoCuda,
        _: &NoCuda,
        _: f32,
        _: usize,
        _: usize,
        _: &mut NoCuda,
    ) {
        match *self {}
    }
    fn linear(&mut self, _: &NoCuda, _: &NoCuda, _: usize, _: &mut NoCuda) {
        match *self {}
    }
    fn lora(
        &mut self,
        _: &NoCuda,
        _: &mut NoCuda,
        _: LinearDims,
        _: (LayerIdx, LoraModule),
        _: &LoraBatch<'_, NoCuda>,
    ) {
        match *self {}
    }
    fn rope(&mut self, _: &mut NoCuda, _: &[usize], _: usize) {
        match *self {}
    }
    fn attention(
        &mut self,
        _: &NoCuda,
        _: &NoCuda,
        _: &NoCuda,
        _: &mut NoCuda,
        _: &StepLayout,
        _: &mut NoCuda,
    ) {
        match *self {}
    }
    fn swiglu(&mut self, _: &NoCuda, _: &NoCuda, _: usize, _: &mut NoCuda) {
        match *self {}
    }
    fn add(&mut self, _: &mut NoCuda, _: &NoCuda, _: usize) {
        match *self {}
    }
    fn gather_rows(&mut self, _: &NoCuda, _: usize, _: &[usize], _: &mut NoCuda) {
        match *self {}
    }
    fn export_rows(&mut self, _: &NoCuda, _: usize, _: &[Range<usize>], _: &mut [f32], _: usize) {
        match *self {}
    }
    fn merge_rows(&mut self, _: &mut NoCuda, _: usize, _: &[Range<usize>], _: &[f32], _: usize) {
        match *self {}
    }
    fn logits(&mut self, _: &NoCuda, _: &NoCuda, _: usize, _: &mut Vec<f32>) {
        match *self {}
    }
}
