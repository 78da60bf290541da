//! The fitted parameters of a [`PerfModel`] as plain data, for `thaw-bench simulate` to load
//! and replay an instance's behaviour without running one.
use thaw_runtime::residency::LinkModel;

use super::fit::ErrorStat;
use super::model::PerfModel;

/// Everything a [`PerfModel`] predicts from, without the moments of its steps.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PerfSnapshot {
    pub num_layers: usize,
    pub layer_base_s: f64,
    pub layer_per_token_s: f64,
    pub layer_per_decode_s: f64,
    pub lora_sgmv_s: f64,
    pub lora_bgmv_s: f64,
    pub cpu_flops: f64,
    pub cpu_overlaps: bool,
    pub link_gbps: f64,
    pub link_latency_us: f64,
    pub disk_bytes_per_s: f64,
    /// Host encode rate, bytes per second (0: free). Older dumps lack it.
    #[serde(default)]
    pub host_encode_bytes_per_s: f64,
    /// Whether CPU assist can start from the disk tier. Older dumps lack it (false).
    #[serde(default)]
    pub assist_reads_disk: bool,
    pub assist_layer_overhead_s: f64,
    /// Device time of an assisted step over the same step without assist. Older dumps lack
    /// it (1: assist does not slow the device).
    #[serde(default = "one")]
    pub assist_device_factor: f64,
    /// Page-cache read rate of an adapter file in place, bytes per second. Older dumps lack
    /// it (0: the disk rate).
    #[serde(default)]
    pub file_read_bytes_per_s: f64,
    /// How well the model predicted each step before it was measured (recent steps weigh
    /// most).
    pub error: ErrorStat,
    /// Root-mean-square error of the device-time fit over every step of the run, relative
    /// to the mean step (0: no step yet). Older dumps lack it.
    #[serde(default)]
    pub fit_rms_rel: f64,
    /// Mean wall time of the engine thread between two back-to-back steps, seconds: what a
    /// step costs beyond the device time the fit predicts. Older dumps lack it (0).
    #[serde(default)]
    pub step_overhead_s: f64,
    /// `a_pre`: extra device time per layer per sequence a step prefills. Older dumps lack
    /// it (0).
    #[serde(default)]
    pub layer_per_prefill_s: f64,
    /// `γ`: extra device time per layer of a step after idle. Older dumps lack it (0: no
    /// step costs more for following an idle engine).
    #[serde(default)]
    pub layer_after_idle_s: f64,
    /// Time without a step after which a step counts as one after idle, seconds. Older dumps
    /// lack it; with `γ` = 0 it changes nothing.
    #[serde(default = "default_after_idle_gap")]
    pub after_idle_gap_s: f64,
}

fn one() -> f64 {
    1.0
}

fn default_after_idle_gap() -> f64 {
    PerfModel::AFTER_IDLE_GAP_S
}

impl PerfModel {
    pub fn snapshot(&self) -> PerfSnapshot {
        PerfSnapshot {
            num_layers: self.num_layers,
            layer_base_s: self.layer_base_s,
            layer_per_token_s: self.layer_per_token_s,
            layer_per_decode_s: self.layer_per_decode_s,
            lora_sgmv_s: self.lora_sgmv_s,
            lora_bgmv_s: self.lora_bgmv_s,
            cpu_flops: self.cpu_flops,
            cpu_overlaps: self.cpu_overlaps,
            link_gbps: self.link.gbps,
            link_latency_us: self.link.latency_us,
            disk_bytes_per_s: self.disk_bytes_per_s,
            host_encode_bytes_per_s: self.host_encode_bytes_per_s,
            assist_reads_disk: self.assist_reads_disk,
            assist_layer_overhead_s: self.assist_layer_overhead_s,
            assist_device_factor: self.assist_device_factor,
            file_read_bytes_per_s: self.file_read_bytes_per_s,
            error: self.error,
            fit_rms_rel: self.fit_rms_rel().unwrap_or(0.0),
            step_overhead_s: self.step_overhead_s,
            layer_per_prefill_s: self.layer_per_prefill_s,
            layer_after_idle_s: self.layer_after_idle_s,
            after_idle_gap_s: self.after_idle_gap_s,
        }
    }

    /// A model that predicts what the snapshotted one did (its step moments start empty).
    pub fn from_snapshot(s: &PerfSnapshot) -> Self {
        Self {
            num_layers: s.num_layers,
            layer_base_s: s.layer_base_s,
            layer_per_token_s: s.layer_per_token_s,
            layer_per_decode_s: s.layer_per_decode_s,
            lora_sgmv_s: s.lora_sgmv_s,
            lora_bgmv_s: s.lora_bgmv_s,
            cpu_flops: s.cpu_flops,
            cpu_overlaps: s.cpu_overlaps,
            link: LinkModel {
                gbps: s.link_gbps,
                latency_us: s.link_latency_us,
            },
            disk_bytes_per_s: s.disk_bytes_per_s,
            host_encode_bytes_per_s: s.host_encode_bytes_per_s,
            assist_reads_disk: s.assist_reads_disk,
            assist_layer_overhead_s: s.assist_layer_overhead_s,
            assist_device_factor: s.assist_device_factor,
            file_read_bytes_per_s: s.file_read_bytes_per_s,
            error: s.error,
            step_overhead_s: s.step_overhead_s,
            layer_per_prefill_s: s.layer_per_prefill_s,
            layer_after_idle_s: s.layer_after_idle_s,
            after_idle_gap_s: s.after_idle_gap_s,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::StepShape;

    #[test]
    fn a_snapshot_round_trips_through_json_and_predicts_alike() {
        let m = PerfModel {
            layer_base_s: 3e-4,
            layer_per_token_s: 2e-5,
            layer_per_decode_s: 4e-6,
            lora_sgmv_s: 5e-8,
            lora_bgmv_s: 2e-8,
            num_layers: 12,
            disk_bytes_per_s: 7e8,
            host_encode_bytes_per_s: 3e9,
            assist_reads_disk: true,
            step_overhead_s: 2e-4,
            layer_per_prefill_s: 9e-4,
            layer_after_idle_s: 6e-4,
            after_idle_gap_s: 0.03,
            ..Default::default()
        };
        let json = serde_json::to_string(&m.snapshot()).unwrap();
        let back = PerfModel::from_snapshot(&serde_json::from_str(&json).unwrap());
        assert_eq!(back.snapshot(), m.snapshot());
        let mut shape = StepShape::default();
        shape.add(40, false, Some(16));
        shape.add(3, true, Some(64));
        assert_eq!(back.predict(&shape), m.predict(&shape));
        shape.after_idle = true;
        assert_eq!(back.predict(&shape), m.predict(&shape));
        assert!(back.is_after_idle(Some(0.03)) && !back.is_after_idle(Some(0.029)));
    }

    #[test]
    fn a_dump_older_than_the_overhead_reads_as_none() {
        let mut v = serde_json::to_value(PerfModel::default().snapshot()).unwrap();
        let o = v.as_object_mut().unwrap();
        assert!(o.remove("step_overhead_s").is_some() && o.remove("fit_rms_rel").is_some());
        let s: PerfSnapshot = serde_json::from_value(v).unwrap();
        assert_eq!((s.step_overhead_s, s.fit_rms_rel), (0.0, 0.0));
    }

    #[test]
    fn a_dump_older_than_the_prefill_and_after_idle_terms_predicts_as_before() {
        let m = PerfModel {
            layer_base_s: 3e-4,
            layer_per_token_s: 2e-5,
            num_layers: 12,
            ..Default::default()
        };
        let mut v = serde_json::to_value(m.snapshot()).unwrap();
        let o = v.as_object_mut().unwrap();
        for k in [
            "layer_per_prefill_s",
            "layer_after_idle_s",
            "after_idle_gap_s",
        ] {
            assert!(o.remove(k).is_some(), "{k}");
        }
        let s: PerfSnapshot = serde_json::from_value(v).unwrap();
        assert_eq!((s.layer_per_prefill_s, s.layer_after_idle_s), (0.0, 0.0));
        let old = PerfModel::from_snapshot(&s);
        let mut shape = StepShape::default();
        shape.add(40, false, Some(16));
        let warm = old.predict(&shape);
        let want = 12.0 * (3e-4 + 2e-5 * 40.0 + 1e-8 * 40.0 * 16.0);
        assert!((warm - want).abs() < 1e-12, "{warm} vs {want}");
        shape.after_idle = true;
        assert_eq!(old.predict(&shape), warm, "a missing column costs nothing");
    }
}
