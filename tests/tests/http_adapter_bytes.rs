//! Adapters keep their stored dtype from file to device (issue 27): a bf16 adapter is 2 bytes a
//! weight, and `/v1/models` and `/metrics` report those bytes, not an f32 copy's; a request on
//! it gives the tokens the engine gives for the same adapter.
use serde_json::{json, Value};
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::model::ModelConfig;
use thaw_server::gen::{self, GenAdaptersOptions, Projection, WeightDtype};
use thaw_server::serve::Server;
use thaw_tests::http::{call_router, metric, ServeFixture};

/// Bytes of the tensors in an adapter's safetensors file: the file minus its 8-byte header
/// length and the JSON header.
fn tensor_bytes(dir: &std::path::Path) -> usize {
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes.len() - 8 - header
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_adapter_is_served_and_reported_at_its_stored_size() {
    let mut fx = ServeFixture::new(&[16]);
    // The same rank and seed, saved in bf16 next to the f32 one.
    let written = gen::write_adapters(&GenAdaptersOptions {
        model_dir: fx.model_dir(),
        out_dir: fx.dir.path().join("staging-bf16"),
        count: 1,
        ranks: vec![16],
        targets: Projection::ALL.to_vec(),
        seed: 50,
        dtype: Some(WeightDtype::Bf16),
        ..Default::default()
    })
    .unwrap();
    fx.adapters.push(("lora-bf16".into(), written[0].clone()));
    let (f32_file, bf16_file) = (tensor_bytes(&fx.adapters[0].1), tensor_bytes(&written[0]));
    assert_eq!(2 * bf16_file, f32_file);
    let config = ModelConfig::from_dir(&fx.model_dir()).unwrap();
    let host = LoraAdapter::load(&written[0], &config).unwrap();
    assert_eq!(
        host.size_bytes(),
        bf16_file,
        "the host copy is not the file's bytes"
    );

    let server = Server::start(fx.config()).await.unwrap();
    let app = server.router();
    let (status, body) = call_router(&app, "GET", "/v1/models", None).await;
    assert_eq!(status, 200, "{body}");
    let models: Value = serde_json::from_str(&body).unwrap();
    let size = |id: &str| {
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id)
            .and_then(|m| m["size_bytes"].as_u64())
            .unwrap_or_else(|| panic!("{id} not in {body}"))
    };
    assert_eq!(size("lora-bf16") as usize, bf16_file);
    assert_eq!(size(&fx.adapters[0].0) as usize, f32_file);

    // A request on the bf16 adapter runs, and /metrics counts its stored bytes on the device.
    let req = json!({"model": "lora-bf16", "prompt": "the quick fox", "max_tokens": 4,
        "temperature": 0.0, "ignore_eos": true});
    let (status, body) = call_router(&app, "POST", "/v1/completions", Some(req.to_string())).await;
    assert_eq!(status, 200, "{body}");
    let (_, m) = call_router(&app, "GET", "/metrics", None).await;
    let on_device = metric(&m, "thaw_adapter_device_memory_bytes").unwrap() as usize;
    assert!(
        on_device == bf16_file || on_device == bf16_file + f32_file,
        "{on_device} bytes on the device: neither the bf16 adapter nor both"
    );
    // The pinned upload arena, the host tier's encoded images, is published too.
    let arena = metric(&m, "thaw_host_arena_bytes{use=\"capacity\"}").unwrap();
    let used = metric(&m, "thaw_host_arena_bytes{use=\"used\"}").unwrap();
    let kept = metric(&m, "thaw_adapter_tier_bytes{tier=\"host_arena\"}").unwrap();
    assert!(arena > 0.0 && kept <= used && used <= arena, "{m}");
}
