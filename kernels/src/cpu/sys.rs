//! The crate's only `unsafe`: a bounds-checked safe wrapper over `matrixmultiply::sgemm`.

/// A read-only strided matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix view, laid out like [`MatRef`].
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rs: usize,
    pub cs: usize,
}

/// Panics unless every element of a `rows × cols` view with these strides lies inside `len`.
fn check_view(what: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)));
    assert!(
        matches!(last, Some(l) if l < len),
        "sgemm: {what} view {rows}x{cols} (strides {rs},{cs}) exceeds its buffer of {len}"
    );
    assert!(
        isize::try_from(rs).is_ok() && isize::try_from(cs).is_ok(),
        "sgemm: {what} stride does not fit isize"
    );
}

/// `C[m,n] ← alpha · A[m,k] · B[k,n] + beta · C`, single-threaded. With `beta == 0` the old
/// contents of `C` are ignored (NaNs included).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) {
    check_view("A", a.data.len(), m, k, a.rs, a.cs);
    check_view("B", b.data.len(), k, n, b.rs, b.cs);
    check_view("C", c.data.len(), m, n, c.rs, c.cs);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // Empty inner dimension: the product is zero; do not hand matrixmultiply empty slices.
        for i in 0..m {
            for j in 0..n {
                let y = &mut c.data[i * c.rs + j * c.cs];
                *y = if beta == 0.0 { 0.0 } else { beta * *y };
            }
        }
        return;
    }
    // SAFETY: `check_view` proved that every index (i*rs + j*cs) the three m×k, k×n, m×n views
    // can touch is inside its slice, and that the strides fit `isize`; A and B are only read; C
    // is an exclusive `&mut` borrow, so nothing else reads or writes it during the call.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.data.as_mut_ptr(),
            c.rs as isize,
            c.cs as isize,
        );
    }
}
