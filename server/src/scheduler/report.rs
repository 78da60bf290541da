//! The scheduler's and the performance model's numbers for /metrics: per-queue length and
//! quota, the output-length predictor's error and the step-time model's error. The engine
//! loop publishes a snapshot now and then; the scrape renders the latest.
use std::sync::Mutex;

use super::select::SchedSnapshot;
use crate::metrics::{header, sample};
use crate::perf::PerfSnapshot;

/// The latest snapshot, shared between the engine loop and /metrics.
#[derive(Debug, Default)]
pub struct SchedBoard(Mutex<Option<(SchedSnapshot, PerfSnapshot)>>);

impl SchedBoard {
    pub fn publish(&self, sched: SchedSnapshot, perf: PerfSnapshot) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((sched, perf));
    }

    pub fn get(&self) -> Option<(SchedSnapshot, PerfSnapshot)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Writes the `thaw_sched_*` and `thaw_perf_*` families (nothing before the first
    /// snapshot).
    pub fn render(&self, out: &mut String) {
        let Some((s, p)) = self.get() else {
            return;
        };
        header(
            out,
            "thaw_sched_policy_info",
            "The --scheduling-policy in force.",
            "gauge",
        );
        sample(
            out,
            "thaw_sched_policy_info",
            &[("policy", s.policy.name())],
            1.0,
        );
        header(
            out,
            "thaw_sched_queue_waiting",
            "Requests waiting in each multi-level queue (0 = smallest requests).",
            "gauge",
        );
        for (i, q) in s.queues.iter().enumerate() {
            let i = i.to_string();
            sample(
                out,
                "thaw_sched_queue_waiting",
                &[("queue", &i)],
                q.waiting as f64,
            );
        }
        header(
            out,
            "thaw_sched_queue_quota_tokens",
            "Token quota of each multi-level queue (KV tokens its running requests may hold).",
            "gauge",
        );
        for (i, q) in s.queues.iter().enumerate() {
            let i = i.to_string();
            sample(
                out,
                "thaw_sched_queue_quota_tokens",
                &[("queue", &i)],
                q.quota_tokens as f64,
            );
        }
        for (name, help, v) in [
            (
                "thaw_sched_predictor_samples",
                "Finished requests the output-length predictor was scored on.",
                s.predictor.count as f64,
            ),
            (
                "thaw_sched_predictor_abs_error_tokens",
                "Mean |predicted - actual| output length, tokens.",
                s.predictor.mean_abs_err,
            ),
            (
                "thaw_sched_predictor_accuracy",
                "Mean of min(predicted, actual) / max(predicted, actual) output length.",
                s.predictor.accuracy,
            ),
            (
                "thaw_perf_model_samples",
                "Steps the performance model predicted before measuring them.",
                p.error.count as f64,
            ),
            (
                "thaw_perf_model_rel_error",
                "Mean relative error of the predicted step time (recent steps weigh most).",
                p.error.mean_rel,
            ),
        ] {
            header(out, name, help, "gauge");
            sample(out, name, &[], v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::PerfModel;
    use crate::scheduler::{QueueInfo, SchedulingPolicy};

    #[test]
    fn renders_queues_predictor_and_model_error() {
        let b = SchedBoard::default();
        let mut out = String::new();
        b.render(&mut out);
        assert!(out.is_empty());
        let mut s = SchedSnapshot {
            policy: SchedulingPolicy::Mlq,
            ..Default::default()
        };
        s.queues = vec![
            QueueInfo {
                waiting: 3,
                quota_tokens: 100,
            },
            QueueInfo {
                waiting: 1,
                quota_tokens: 900,
            },
        ];
        s.predictor.accuracy = 0.75;
        let mut m = PerfModel::default();
        m.error.observe(1.2, 1.0);
        b.publish(s, m.snapshot());
        b.render(&mut out);
        assert!(out.contains("thaw_sched_policy_info{policy=\"mlq\"} 1"));
        assert!(out.contains("thaw_sched_queue_waiting{queue=\"1\"} 1"));
        assert!(out.contains("thaw_sched_queue_quota_tokens{queue=\"0\"} 100"));
        assert!(out.contains("thaw_sched_predictor_accuracy 0.75"));
        assert!(out.contains("thaw_perf_model_samples 1"));
    }
}
