//! `GET /v1/models`, vLLM's adapter load/unload, `GET /health` and `GET /metrics`.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::app::AppState;
use super::error::OpenAiJson;
use super::openai_types::{LoadLoraRequest, UnloadLoraRequest};
use crate::error::ServerError;
use crate::metrics::{header as metric_header, sample};
use crate::registry::AdapterView;

/// Adapters shown with their own label in /metrics; the rest are summed under "other".
pub const TOP_ADAPTER_LABELS: usize = 16;

fn adapter_json(state: &AppState, a: &AdapterView) -> Value {
    json!({
        "id": a.name,
        "object": "model",
        "created": a.created,
        "owned_by": "thaw",
        "root": a.path.display().to_string(),
        "parent": state.base_name(),
        "max_model_len": state.max_model_len,
        "rank": a.rank,
        "targets": a.targets,
        "tier": a.tier,
        "landed_layers": a.landed_layers,
        "num_layers": a.num_layers,
        "generation": a.generation.0,
        "size_bytes": a.size_bytes,
        "permission": [],
    })
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let mut data = vec![json!({
        "id": state.base_name(),
        "object": "model",
        "created": state.created,
        "owned_by": "thaw",
        "root": state.model_root,
        "parent": null,
        "max_model_len": state.max_model_len,
        "permission": [],
    })];
    data.extend(
        state
            .registry
            .views()
            .iter()
            .filter(|a| !a.retiring)
            .map(|a| adapter_json(&state, a)),
    );
    // How the device budget is split now, and the tiers' sizes (Thaw's addition).
    let memory = state.registry.board().stats.snapshot();
    Json(json!({"object": "list", "data": data, "memory": memory}))
}

pub async fn load_lora(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<LoadLoraRequest>,
) -> Result<Json<Value>, ServerError> {
    let name = req.lora_name.trim();
    if name.is_empty() {
        return Err(ServerError::invalid("lora_name", "`lora_name` is empty"));
    }
    if state.served_names.iter().any(|n| n == name) {
        return Err(ServerError::invalid(
            "lora_name",
            format!("`{name}` is the base model's name; pick another adapter name"),
        ));
    }
    if req.lora_path.is_empty() {
        return Err(ServerError::invalid("lora_path", "`lora_path` is empty"));
    }
    let path = state.lora_access.resolve(name, &req.lora_path)?;
    let view = state
        .registry
        .load_with(
            name,
            &path,
            state.lora_access.root(),
            state.lora_access.reader(name, &path),
        )
        .await
        .map_err(|e| state.lora_access.relative_error(e))?;
    tracing::info!(
        "loaded adapter `{name}` generation {} (rank {}, {} tier) from {}",
        view.generation,
        view.rank,
        serde_json::to_string(&view.tier).unwrap_or_default(),
        req.lora_path
    );
    let mut body = adapter_json(&state, &view);
    body["message"] = json!(format!(
        "Success: LoRA adapter '{name}' added successfully."
    ));
    Ok(Json(body))
}

pub async fn unload_lora(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<UnloadLoraRequest>,
) -> Result<Json<Value>, ServerError> {
    state.registry.unload(&req.lora_name).await?;
    Ok(Json(json!({
        "id": req.lora_name,
        "message": format!("Success: LoRA adapter '{}' removed successfully.", req.lora_name),
    })))
}

pub async fn health(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ServerError> {
    if !state.engine.stats.alive.load(Ordering::SeqCst) {
        return Err(ServerError::SchedulerGone);
    }
    Ok(Json(json!({"status": "ok"})))
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut out = String::with_capacity(8192);
    state.metrics.render(&mut out);
    let s = &state.engine.stats;
    let views = state.registry.views();
    let device: Vec<&AdapterView> = views
        .iter()
        .filter(|a| a.tier == crate::registry::Tier::Device)
        .collect();
    let heap = crate::serve::idle_trim::heap_stats();
    let gauges: [(&str, &str, f64); 16] = [
        (
            "thaw_num_requests_waiting",
            "Requests queued, not yet admitted.",
            s.waiting.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_num_requests_running",
            "Requests in the running batch.",
            s.running.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_kv_cache_used_blocks",
            "KV cache blocks in use.",
            s.kv_used_blocks.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_kv_cache_total_blocks",
            "KV cache blocks in total.",
            s.kv_total_blocks.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use.",
            {
                let t = s.kv_total_blocks.load(Ordering::Relaxed).max(1) as f64;
                s.kv_used_blocks.load(Ordering::Relaxed) as f64 / t
            },
        ),
        (
            "thaw_engine_steps_total",
            "Engine steps run.",
            s.steps.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_emulated_step_padding_seconds_total",
            "Seconds the engine thread slept to pad steps to --emulated-step-time (bench-only).",
            s.emulated_pad_ns.load(Ordering::Relaxed) as f64 / 1e9,
        ),
        (
            "thaw_cpu_assisted_rows_total",
            "Row·modules whose LoRA delta was computed on the CPU while the adapter streamed in.",
            s.cpu_assisted_rows.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_cpu_assisted_steps_total",
            "Engine steps in which CPU LoRA assist computed a delta for an adapter not yet on the device.",
            s.cpu_assisted_steps.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_cold_start_layer_waits_total",
            "Requests that ran before their adapter was on the device, their step waiting for each layer of it as it landed.",
            s.cold_layer_waits.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_cold_start_holds_total",
            "Requests the cold-start gate held for at least one step, admitted while their adapter's copy to the device had not landed.",
            s.cold_holds.load(Ordering::Relaxed) as f64,
        ),
        (
            "thaw_adapter_leases",
            "Live adapter leases (requests pinning an adapter).",
            state.registry.total_leases() as f64,
        ),
        (
            "thaw_adapters_device",
            "Adapters resident in device memory.",
            device.len() as f64,
        ),
        (
            "thaw_adapter_device_memory_bytes",
            "Device memory held by resident adapters.",
            device.iter().map(|a| a.size_bytes).sum::<usize>() as f64,
        ),
        (
            "thaw_heap_allocated_bytes",
            "Bytes in live heap allocations (glibc mallinfo2; NaN with another allocator).",
            heap.map_or(f64::NAN, |h| h.allocated as f64),
        ),
        (
            "thaw_heap_held_bytes",
            "Heap bytes taken from the OS, live or free inside the allocator's arenas.",
            heap.map_or(f64::NAN, |h| h.held as f64),
        ),
    ];
    for (name, help, v) in gauges {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        metric_header(&mut out, name, help, kind);
        sample(&mut out, name, &[], v);
    }
    let name = "thaw_engine_time_seconds_total";
    metric_header(
        &mut out,
        name,
        "Seconds the engine thread spent, by cause: forward steps, adapter work, scheduling, idle.",
        "counter",
    );
    for c in crate::perf::Cause::ALL {
        sample(&mut out, name, &[("cause", c.name())], s.time.seconds(c));
    }
    render_adapters(&mut out, &views);
    crate::metrics_protocol::render(
        &mut out,
        &crate::metrics_protocol::ProtocolSnapshot {
            model_name: state.base_name(),
            waiting: s.waiting.load(Ordering::Relaxed),
            running: s.running.load(Ordering::Relaxed),
            kv_used_blocks: s.kv_used_blocks.load(Ordering::Relaxed),
            kv_total_blocks: s.kv_total_blocks.load(Ordering::Relaxed),
            max_loras: state.registry.limits.max_loras,
            lora_series: s.lora.series(),
            names: views.iter().map(|a| (a.id, a.name.as_str())).collect(),
            preemptions: s.preemptions.load(Ordering::Relaxed),
            prefix_queries: s.prefix_queries.load(Ordering::Relaxed),
            prefix_hits: s.prefix_hits.load(Ordering::Relaxed),
        },
    );
    state.registry.board().stats.snapshot().render(&mut out);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// Per-adapter series, bounded: the TOP_ADAPTER_LABELS adapters with most requests get their
/// own label, the rest are summed as adapter="other".
fn render_adapters(out: &mut String, views: &[AdapterView]) {
    let mut sorted: Vec<&AdapterView> = views.iter().filter(|a| !a.retiring).collect();
    sorted.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.name.cmp(&b.name)));
    let (top, rest) = sorted.split_at(sorted.len().min(TOP_ADAPTER_LABELS));
    type Get = fn(&AdapterView) -> f64;
    let series: [(&str, &str, &str, Get); 6] = [
        (
            "thaw_adapter_requests_total",
            "Requests per adapter.",
            "counter",
            |a| a.requests as f64,
        ),
        (
            "thaw_adapter_cache_hits_total",
            "Requests that found the adapter device-resident.",
            "counter",
            |a| a.hits as f64,
        ),
        (
            "thaw_adapter_cache_misses_total",
            "Requests that had to load the adapter.",
            "counter",
            |a| a.misses as f64,
        ),
        (
            "thaw_adapter_cpu_assisted_rows_total",
            "Rows computed by CPU workers while the adapter loaded.",
            "counter",
            |a| a.cpu_assisted_rows as f64,
        ),
        (
            "thaw_adapter_tier",
            "Where the adapter lives: 0 disk, 1 host, 2 device.",
            "gauge",
            |a| a.tier.code() as f64,
        ),
        (
            "thaw_adapter_load_latency_seconds",
            "Duration of the adapter's last load.",
            "gauge",
            |a| a.load_secs.unwrap_or(0.0),
        ),
    ];
    for (name, help, kind, get) in series {
        metric_header(out, name, help, kind);
        for a in top {
            sample(out, name, &[("adapter", &a.name)], get(a));
        }
        if !rest.is_empty() && kind == "counter" {
            sample(
                out,
                name,
                &[("adapter", "other")],
                rest.iter().map(|a| get(a)).sum(),
            );
        }
    }
    metric_header(
        out,
        "thaw_adapter_landed_layers",
        "Layers of the adapter resident on the device.",
        "gauge",
    );
    for a in top {
        sample(
            out,
            "thaw_adapter_landed_layers",
            &[("adapter", &a.name)],
            a.landed_layers as f64,
        );
    }
}
