//! Adapters whose upload failed (issue 27): a layer read from the adapter's mapped file failed
//! its check (a NaN or infinite weight; the file truncated or replaced since it was mapped) or
//! a copy to the device failed. The upload pipeline frees the image's arena space once and
//! marks the adapter's device copy failed with the reason; it will never land. Before each
//! step the loop fails every request for such an adapter (waiting or running) with an OpenAI
//! error body that names the adapter, what failed and what to do, drops the adapter from the
//! engine (its device pages go back once) and the mapped host copy with it; every other
//! request runs on untouched.
use thaw_runtime::ids::AdapterId;

use super::Loop;
use crate::perf::Cause;

impl Loop {
    /// Fails the requests of every adapter whose upload failed and drops the adapter; a
    /// no-op (one pass over the engine's adapters) when none did.
    pub(super) fn fail_failed_uploads(&mut self) {
        let failed = self.engine.failed_uploads();
        if failed.is_empty() {
            return;
        }
        let prev = self.charge(Cause::Adapter);
        for (id, why) in failed {
            let msg = upload_failed_message(&self.adapter_label(id), &why);
            tracing::error!(adapter = id.0, "{msg}");
            self.fail_adapter_requests(id, &msg);
            let wanted = self.state.waiting_adapters();
            if self.engine.has_adapter(id) {
                match self.engine.unregister_adapter(id) {
                    Ok(()) => self.mem.on_upload_failed(id, &wanted),
                    Err(e) => tracing::warn!("dropping adapter {id} whose upload failed: {e}"),
                }
            }
        }
        self.charge(prev);
    }

    /// How a client knows adapter `id`: "adapter `name`" from a live request's lease, else by
    /// its number.
    pub(super) fn adapter_label(&self, id: AdapterId) -> String {
        let name = self
            .state
            .waiting
            .iter()
            .chain(&self.state.running)
            .filter(|s| s.adapter == Some(id))
            .find_map(|s| Some(self.live.get(&s.id)?.lease.as_ref()?.slot().name.clone()));
        name.map_or_else(|| format!("adapter {}", id.0), |n| format!("adapter `{n}`"))
    }
}

/// The error a request for an adapter whose upload failed gets: which adapter, why (the
/// pipeline's reason: the layer and what was wrong with it), and what to do.
pub(super) fn upload_failed_message(who: &str, why: &str) -> String {
    format!("{who} failed to load: {why}; re-upload the adapter's files and load it again")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_adapter_the_layer_and_what_to_do() {
        let why = "layer 1 of its file failed its check: tensor `layer 1 q_proj lora_A` holds \
                   NaN or infinite values (element 1); the file is corrupt or the training \
                   diverged — re-save or retrain the adapter";
        let m = upload_failed_message("adapter `sql-lora`", why);
        assert!(
            m.starts_with("adapter `sql-lora` failed to load: layer 1 of its file"),
            "{m}"
        );
        assert!(m.contains("NaN") && m.contains("re-upload"), "{m}");
    }
}
