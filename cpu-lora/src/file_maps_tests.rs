use std::io::Write;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_ipc::{
    AdapterId, DType, FileSource, FileTensors, Generation, HostStore, LayerIdx, LayerModuleWeights,
    Module, ModuleShape,
};

use super::*;
use crate::compute::weight_dtype;
use crate::kernel::{lora_delta, LoraMat, LoraProblem, Scratch};

const RANK: usize = 8;
const D_IN: usize = 48;
const D_OUT: usize = 40;
const ROWS: usize = 5;

fn encode(v: &[f32], dt: DType) -> Vec<u8> {
    match dt {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
    }
}

fn decode(b: &[u8], dt: DType) -> Vec<f64> {
    match dt {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| f64::from(half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
    }
}

/// A file with an odd-length header, then A and B of one (layer, module): offsets not aligned
/// to the element size, as a safetensors file mixing dtypes can have them.
struct Fixture {
    _dir: tempfile::TempDir,
    src: FileSource,
    tensors: FileTensors,
    a: Vec<u8>,
    b: Vec<u8>,
}

fn fixture(dt: DType, seed: u64) -> Fixture {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let a = encode(&vals(RANK * D_IN), dt);
    let b = encode(&vals(D_OUT * RANK), dt);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter_model.safetensors");
    let header = vec![b'{'; 37];
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&header).unwrap();
    f.write_all(&a).unwrap();
    f.write_all(&b).unwrap();
    drop(f);
    let src = FileSource::of(path).unwrap();
    let tensors = FileTensors {
        layer: LayerIdx(1),
        module: Module::V,
        shape: ModuleShape {
            rank: RANK as u32,
            scale: 0.75,
            dtype: dt,
            d_in: D_IN as u32,
            d_out: D_OUT as u32,
        },
        a_off: header.len() as u64,
        b_off: (header.len() + a.len()) as u64,
    };
    Fixture {
        _dir: dir,
        src,
        tensors,
        a,
        b,
    }
}

fn delta(w: &LoraWeights<'_>, x: &[f32]) -> Vec<f32> {
    let p = LoraProblem {
        rows: ROWS,
        d_in: w.d_in as usize,
        d_out: w.d_out as usize,
        rank: w.rank as usize,
        scale: w.scale,
    };
    let dtype = weight_dtype(w.dtype);
    let mut out = vec![0.0; ROWS * D_OUT];
    lora_delta(
        &p,
        x,
        LoraMat { dtype, bytes: w.a },
        LoraMat { dtype, bytes: w.b },
        &mut out,
        false,
        &mut Scratch::new(),
    )
    .unwrap();
    out
}

/// From the file, Δ matches an f64 oracle over the stored values within DESIGN §9's f32
/// tolerance (relative 1e-4 of the row's scale: f32 accumulation over d_in + rank terms), and
/// is bit-identical to the same bytes read from the arena.
#[test]
fn deltas_from_the_file_match_the_oracle_and_the_arena() {
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let fx = fixture(dt, 11 + i as u64);
        let mut store = HostStore::create(1 << 20, 4).unwrap();
        let fh = store
            .insert_file(AdapterId(1), Generation(1), &fx.src, &[fx.tensors])
            .unwrap();
        let ah = store
            .insert(
                AdapterId(2),
                Generation(1),
                &[LayerModuleWeights {
                    layer: LayerIdx(1),
                    module: Module::V,
                    rank: RANK as u32,
                    scale: 0.75,
                    dtype: dt,
                    a_bytes: &fx.a,
                    b_bytes: &fx.b,
                }],
            )
            .unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(99);
        let x: Vec<f32> = (0..ROWS * D_IN)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let mut maps = FileMaps::default();
        let w = maps
            .weights(&store, fh, LayerIdx(1), Module::V)
            .unwrap()
            .unwrap();
        assert_eq!(w.a, &fx.a[..]);
        assert_eq!(w.b, &fx.b[..]);
        let from_file = delta(&w, &x);
        let view = store.view(ah, LayerIdx(1), Module::V).unwrap();
        let from_arena = delta(&view, &x);
        assert_eq!(from_file, from_arena, "{dt:?}");
        let (a, b) = (decode(&fx.a, dt), decode(&fx.b, dt));
        for r in 0..ROWS {
            let t: Vec<f64> = (0..RANK)
                .map(|k| {
                    (0..D_IN)
                        .map(|c| f64::from(x[r * D_IN + c]) * a[k * D_IN + c])
                        .sum()
                })
                .collect();
            let want: Vec<f64> = (0..D_OUT)
                .map(|o| 0.75 * (0..RANK).map(|k| t[k] * b[o * RANK + k]).sum::<f64>())
                .collect();
            let norm = want.iter().map(|v| v.abs()).fold(1e-6, f64::max);
            for o in 0..D_OUT {
                let err = (f64::from(from_file[r * D_OUT + o]) - want[o]).abs() / norm;
                assert!(err < 1e-4, "{dt:?} row {r} col {o}: rel err {err:e}");
            }
        }
        // Not a file entry, or not targeted: no weights, no error.
        assert!(maps
            .weights(&store, ah, LayerIdx(1), Module::V)
            .unwrap()
            .is_none());
        assert!(maps
            .weights(&store, fh, LayerIdx(0), Module::V)
            .unwrap()
            .is_none());
        assert_eq!(maps.len(), 1);
    }
}

#[test]
fn a_retired_entry_is_unmapped_and_a_changed_file_is_refused() {
    let fx = fixture(DType::BF16, 3);
    let mut store = HostStore::create(1 << 20, 4).unwrap();
    let h = store
        .insert_file(AdapterId(1), Generation(1), &fx.src, &[fx.tensors])
        .unwrap();
    let mut maps = FileMaps::default();
    assert!(maps
        .weights(&store, h, LayerIdx(1), Module::V)
        .unwrap()
        .is_some());
    maps.tend(&store);
    assert_eq!(maps.len(), 1, "a live entry stays mapped");
    store.remove(h);
    maps.tend(&store);
    assert!(maps.is_empty(), "a retired entry is unmapped");

    // Truncated in place after it was mapped: refused at the next step, with the reason.
    let h = store
        .insert_file(AdapterId(1), Generation(2), &fx.src, &[fx.tensors])
        .unwrap();
    assert!(maps
        .weights(&store, h, LayerIdx(1), Module::V)
        .unwrap()
        .is_some());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&fx.src.path)
        .unwrap()
        .set_len(fx.src.len - 10)
        .unwrap();
    maps.tend(&store);
    let e = maps.weights(&store, h, LayerIdx(1), Module::V).unwrap_err();
    assert!(e.contains("changed length"), "{e}");
    // A new generation registered over the truncated file: refused before mapping.
    let h3 = store
        .insert_file(AdapterId(1), Generation(3), &fx.src, &[fx.tensors])
        .unwrap();
    let e = maps
        .weights(&store, h3, LayerIdx(1), Module::V)
        .unwrap_err();
    assert!(e.contains("truncated or rewritten"), "{e}");
    // Gone from disk.
    std::fs::remove_file(&fx.src.path).unwrap();
    let h4 = store
        .insert_file(AdapterId(1), Generation(4), &fx.src, &[fx.tensors])
        .unwrap();
    let e = maps
        .weights(&store, h4, LayerIdx(1), Module::V)
        .unwrap_err();
    assert!(e.contains("cannot read"), "{e}");
}
