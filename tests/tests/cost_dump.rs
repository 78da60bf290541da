//! `thaw serve --dump-cost-model PATH` writes the performance model the engine fitted (its
//! `PerfSnapshot`), the adapter sizes and load rates the registry measured and the server's
//! limits, and the engine loop's overhead per step, at shutdown (and every 10 s), in the
//! format `thaw-bench simulate` reads.
use serde_json::json;
use thaw_server::coldstart::CostSnapshot;
use thaw_tests::http::{post, ServeFixture, SocketServer};

#[test]
fn serve_dumps_its_cost_model_at_shutdown() {
    let fx = ServeFixture::new(&[8, 16]);
    let path = fx.dir.path().join("cost-model.json");
    let mut cfg = fx.config();
    cfg.dump_cost_model = Some(path.clone());
    cfg.max_loras = 2;
    cfg.max_cpu_loras = 5;
    let srv = SocketServer::start(cfg.clone());
    for (i, (name, _)) in fx.adapters.iter().enumerate() {
        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"model": name, "prompt": "count the steps", "max_tokens": 8 + i,
                    "ignore_eos": true}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    drop(srv); // graceful shutdown writes the file
    let s = CostSnapshot::read(&path).expect("the dump reads back");
    assert!(s.steps_observed >= 16, "{s:?}");
    assert_eq!(
        s.perf.num_layers,
        thaw_tests::test_preset().num_hidden_layers
    );
    assert!(s.perf.layer_per_token_s > 0.0 && s.perf.cpu_flops > 0.0);
    assert_eq!(s.perf.link_gbps, cfg.emulated_link_gbps);
    assert_eq!(s.limits.max_loras, 2);
    assert_eq!(s.limits.max_cpu_loras, 5);
    assert_eq!(s.limits.max_num_seqs, cfg.max_num_seqs);
    assert_eq!(s.limits.max_num_batched_tokens, cfg.max_num_batched_tokens);
    // Adapters of rank 8 and 16 on the same projections: the same bytes per rank.
    let per_rank = s.adapters.bytes_per_rank.expect("adapters were loaded");
    let preset = thaw_tests::test_preset();
    assert!(per_rank > (preset.hidden_size * preset.num_hidden_layers) as f64);
    assert!(s.adapters.disk_rate_measured && s.perf.disk_bytes_per_s > 0.0);
    // Requests of 8+ tokens ran steps back to back: the loop timed the gaps between them,
    // and the pooled fit reports its own error over the run.
    assert!(
        s.perf.step_overhead_s > 0.0 && s.perf.step_overhead_s < 1.0,
        "{:?}",
        s.perf
    );
    assert!(
        s.perf.fit_rms_rel > 0.0 && s.perf.fit_rms_rel.is_finite(),
        "{:?}",
        s.perf
    );
    // The snapshot rebuilds the engine's model (all but the fit's error over steps the
    // rebuilt model has not seen: the dump holds no step moments).
    let m = thaw_server::perf::PerfModel::from_snapshot(&s.perf);
    let back = thaw_server::perf::PerfSnapshot {
        fit_rms_rel: s.perf.fit_rms_rel,
        ..m.snapshot()
    };
    assert_eq!(back, s.perf);
}
