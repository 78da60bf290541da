//! The CUDA backend's [`OpClock`]: a timing event recorded on the compute stream between ops,
//! so that a profiled step's op times are device time (`cuEventElapsedTime` between the
//! events around an op), read once the step is done. Each mark creates its event (a few µs
//! of host time, only while a profile records).
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, DriverError};

use super::{CudaBackend, CudaError};
use crate::backend::profiled::OpClock;
use crate::error::Result;

impl OpClock for CudaBackend {
    /// The event, or why it could not be recorded (reported when the profile is read).
    type Mark = std::result::Result<CudaEvent, DriverError>;

    fn mark(&mut self) -> Self::Mark {
        self.stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
    }

    fn elapsed_us(start: &Self::Mark, end: &Self::Mark) -> Result<f64> {
        let (a, b) = match (start, end) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(CudaError::Driver(*e).into()),
        };
        Ok(f64::from(a.elapsed_ms(b).map_err(CudaError::from)?) * 1e3)
    }
}
