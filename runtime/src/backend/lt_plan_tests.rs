use proptest::prelude::*;

use super::*;

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)]
}

fn shape(rows: usize, weight: DType, bias: bool, out: DType) -> LtShape {
    LtShape {
        rows,
        d_in: 4096,
        d_out: 11008,
        weight,
        bias,
        out,
        addrs: [0, 256, 512],
    }
}

#[test]
fn buckets_are_powers_of_two_at_or_above_the_rows() {
    let want = [
        (0, 1),
        (1, 1),
        (2, 2),
        (3, 4),
        (8, 8),
        (17, 32),
        (128, 128),
        (300, 512),
        (2048, 2048),
    ];
    for (rows, bucket) in want {
        assert_eq!(row_bucket(rows), bucket, "{rows}");
    }
}

#[test]
fn the_workspace_is_32_mib_on_hopper_and_newer_and_4_mib_before() {
    assert_eq!(workspace_bytes(GpuArch::SM90), 32 * 1024 * 1024);
    assert_eq!(
        workspace_bytes(GpuArch {
            major: 10,
            minor: 0
        }),
        32 << 20
    );
    assert_eq!(
        workspace_bytes(GpuArch {
            major: 12,
            minor: 0
        }),
        32 << 20
    );
    assert_eq!(workspace_bytes(GpuArch::SM80), 4 * 1024 * 1024);
    assert_eq!(workspace_bytes(GpuArch { major: 8, minor: 9 }), 4 << 20);
    assert_eq!(workspace_bytes(GpuArch { major: 7, minor: 5 }), 4 << 20);
}

#[test]
fn a_plan_refuses_what_lt_does_not_run_and_says_why() {
    let e = plan(&shape(0, DType::Bf16, false, DType::F32)).unwrap_err();
    assert!(e.contains("empty"), "{e}");
    let e = plan(&shape(4, DType::Bf16, false, DType::F16)).unwrap_err();
    assert!(e.contains("F16") && e.contains("Bf16"), "{e}");
    let e = plan(&shape(4, DType::F32, true, DType::Bf16)).unwrap_err();
    assert!(e.contains("weight dtype"), "{e}");
    let big = LtShape {
        d_out: 1 << 31,
        ..shape(1, DType::Bf16, false, DType::F32)
    };
    assert!(plan(&big).unwrap_err().contains("d_out"));
    // 16-bit D of the weight's dtype, and f32 D of any weights, are planned.
    for w in DType::ALL {
        assert!(plan(&shape(3, w, true, DType::F32)).is_ok());
        assert!(plan(&shape(3, w, false, w)).is_ok());
    }
}

#[test]
fn the_gemv_goes_first_then_lt_then_gemm_ex() {
    assert_eq!(product_path(true, true), ProductPath::Gemv);
    assert_eq!(product_path(true, false), ProductPath::Gemv);
    assert_eq!(product_path(false, true), ProductPath::Lt);
    assert_eq!(product_path(false, false), ProductPath::GemmEx);
    assert_eq!(bias_launches_saved(ProductPath::Lt, true), 1);
    assert_eq!(bias_launches_saved(ProductPath::Lt, false), 0);
    assert_eq!(bias_launches_saved(ProductPath::Gemv, true), 0);
    assert_eq!(bias_launches_saved(ProductPath::GemmEx, true), 0);
}

#[test]
fn alignments_of_typical_addresses() {
    assert_eq!(alignment(0), 256);
    assert_eq!(alignment(1 << 21), 256);
    assert_eq!(alignment(0x7f00_0000_0080), 128);
    assert_eq!(alignment(0x7f00_0000_0002), 2);
    assert_eq!(alignment(3), 1);
    // A view 8 KiB into an allocation keeps 256; one 2 bytes in (a 16-bit row of 1 value) has 2.
    assert_eq!(alignment(0x7f00_0000_0000 + 8192), 256);
    assert_eq!(alignment(0x7f00_0000_0000 + 2), 2);
}

#[test]
fn the_bias_is_read_in_the_output_dtype() {
    for d in DType::ALL {
        assert_eq!(bias_dtype(d), d);
    }
}

proptest! {
    /// The epilogue's f32 bias is the stored bias widened: the upload's encoding, decoded.
    #[test]
    fn the_f32_bias_is_the_stored_bias_widened(
        bias in proptest::collection::vec(-1e4f32..1e4, 0..64),
        w in dtype(),
    ) {
        let wd = match w {
            DType::F32 => crate::adapter::WeightDtype::F32,
            DType::Bf16 => crate::adapter::WeightDtype::Bf16,
            DType::F16 => crate::adapter::WeightDtype::F16,
        };
        let mut bytes = vec![0u8; bias.len() * w.size()];
        crate::adapter::encode_into(&bias, wd, &mut bytes);
        let stored: Vec<f32> = match w {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        let got = bias_f32(&bias, w);
        prop_assert_eq!(got.len(), bias.len());
        for (g, s) in got.iter().zip(&stored) {
            prop_assert_eq!(g.to_bits(), s.to_bits());
        }
    }

    /// The bucket holds the rows and is under twice them; it is a power of two; buckets never
    /// shrink as rows grow.
    #[test]
    fn a_bucket_covers_its_rows(rows in 0usize..1 << 24) {
        let b = row_bucket(rows);
        prop_assert!(b >= rows.max(1));
        prop_assert!(b < 2 * rows.max(1));
        prop_assert!(b.is_power_of_two());
        prop_assert!(row_bucket(rows + 1) >= b);
    }

    /// The key depends on the rows only through their bucket: two row counts of one bucket share
    /// every descriptor, and the plan keeps the exact rows. The epilogue is the bias one iff the
    /// product has a bias; the key carries the dtypes and widths it was asked for.
    #[test]
    fn keys_are_stable_per_bucket(
        rows in 1usize..100_000,
        other in 1usize..100_000,
        d_in in 1usize..20_000,
        d_out in 1usize..200_000,
        w in dtype(),
        bias: bool,
        out16: bool,
        a in 0u64..1 << 40,
        b in 0u64..1 << 40,
        d in 0u64..1 << 40,
    ) {
        let out = if out16 { w } else { DType::F32 };
        let s = LtShape { rows, d_in, d_out, weight: w, bias, out, addrs: [a, b, d] };
        let p = plan(&s).unwrap();
        prop_assert_eq!(p.rows, rows);
        prop_assert_eq!(p.key.bucket, row_bucket(rows));
        prop_assert_eq!((p.key.d_in, p.key.d_out, p.key.weight, p.key.out), (d_in, d_out, w, out));
        prop_assert_eq!(p.key.epilogue == Epilogue::Bias, bias);
        prop_assert_eq!(plan(&s).unwrap(), p, "the same shape, the same plan");
        let q = plan(&LtShape { rows: other, ..s }).unwrap();
        prop_assert_eq!(q.key == p.key, row_bucket(other) == row_bucket(rows));
        let nb = plan(&LtShape { bias: !bias, ..s }).unwrap();
        prop_assert_ne!(nb.key, p.key, "the epilogue is part of the key");
        prop_assert_eq!(p.key.align, [a, b, d].map(alignment));
    }

    /// An alignment is a power of two up to 256 that divides the address.
    #[test]
    fn alignments_divide_their_address(addr in 0u64..1 << 48) {
        let al = alignment(addr);
        prop_assert!(al.is_power_of_two() && al <= MAX_ALIGN);
        prop_assert_eq!(addr % al as u64, 0);
        prop_assert!(al == MAX_ALIGN || addr % (2 * al as u64) != 0, "the largest such");
    }
}
