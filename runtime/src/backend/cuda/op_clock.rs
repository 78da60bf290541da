//! The CUDA backend's [`OpClock`]: a timing event recorded on the compute stream between ops,
//! so that a profiled step's op times are device time (`cuEventElapsedTime` between the
//! events around an op), read once the step is done. Events come from a pool the backend
//! keeps ([`MarkPool`]): a mark only records one (one driver call) instead of creating it and,
//! after the step, destroying it, so the profile's own host work, which the events around a
//! host-bound op measure too, stays small.
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};

use super::{CudaBackend, CudaError};
use crate::backend::profiled::OpClock;
use crate::error::Result;

/// Timing events for marks, reused once no mark holds them.
#[derive(Default)]
pub(super) struct MarkPool {
    events: Vec<Arc<CudaEvent>>,
    /// Where the search for a free event starts (marks are freed in the order they were taken).
    next: usize,
}

impl MarkPool {
    /// Records a free event (created when every event is held) on `stream`.
    fn record(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
    ) -> std::result::Result<Arc<CudaEvent>, DriverError> {
        let n = self.events.len();
        let free = (0..n)
            .map(|k| (self.next + k) % n)
            .find(|&i| Arc::strong_count(&self.events[i]) == 1);
        let i = match free {
            Some(i) => i,
            None => {
                let e = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                self.events.push(Arc::new(e));
                n
            }
        };
        self.next = (i + 1) % self.events.len();
        let e = self.events[i].clone();
        e.record(stream)?;
        Ok(e)
    }
}

impl OpClock for CudaBackend {
    /// The event, or why it could not be recorded (reported when the profile is read).
    type Mark = std::result::Result<Arc<CudaEvent>, DriverError>;

    fn mark(&mut self) -> Self::Mark {
        self.marks.record(&self.gpu.ctx, &self.gpu.stream)
    }

    fn elapsed_us(start: &Self::Mark, end: &Self::Mark) -> Result<f64> {
        let (a, b) = match (start, end) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(CudaError::Driver(*e).into()),
        };
        Ok(f64::from(a.elapsed_ms(b).map_err(CudaError::from)?) * 1e3)
    }
}
