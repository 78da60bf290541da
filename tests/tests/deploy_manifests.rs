//! The Kubernetes manifests (`deploy/k8s`, `deploy/kubernetes`) parse, and what one names
//! another exists and agrees: the InferencePool selects the Thaw pods on their http port and
//! names the EPP's Service and port; the EPP serves that pool with a config it mounts, under a
//! service account its roles bind; the HTTPRoute sends to the pool from a defined Gateway; the
//! API-key patch reaches the Thaw containers and names the Secret the README creates.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every document of every resource a kustomization lists (recursing into directories),
/// plus its `patches`.
fn load_kustomization(dir: &Path, docs: &mut Vec<Value>, patches: &mut Vec<(Value, Value)>) {
    let k: Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("kustomization.yaml"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display())),
    )
    .expect("kustomization parses");
    assert_eq!(k["kind"], "Kustomization");
    for r in k["resources"].as_sequence().expect("resources") {
        let p = dir.join(r.as_str().expect("resource path"));
        if p.is_dir() {
            load_kustomization(&p, docs, patches);
        } else {
            docs.extend(load_docs(&p));
        }
    }
    for p in k["patches"].as_sequence().into_iter().flatten() {
        let file = dir.join(p["path"].as_str().expect("patch path"));
        let mut d = load_docs(&file);
        assert_eq!(d.len(), 1, "{}", file.display());
        patches.push((p["target"].clone(), d.remove(0)));
    }
}

fn load_docs(p: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind} {name}");
    found[0]
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(s) => s.clone(),
                        other => serde_yaml::to_string(other).unwrap().trim().to_string(),
                    };
                    (k.as_str().unwrap().to_string(), v)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn selects(selector: &BTreeMap<String, String>, pod: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| pod.get(k) == Some(v))
}

fn container<'a>(deploy: &'a Value, name: &str) -> &'a Value {
    deploy["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("container {name}"))
}

/// The container port a Service/probe `port` (number or name) refers to.
fn resolve_port(c: &Value, port: &Value) -> u64 {
    let ports = c["ports"].as_sequence().expect("container ports");
    let found = match port {
        Value::Number(n) => ports
            .iter()
            .find(|p| p["containerPort"].as_u64() == n.as_u64()),
        Value::String(s) => ports.iter().find(|p| p["name"] == s.as_str()),
        _ => None,
    };
    found
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {port:?}"))
}

/// `--flag=value` or `--flag value` from an args list.
fn flag(c: &Value, name: &str) -> Option<String> {
    let args: Vec<&str> = c["args"]
        .as_sequence()?
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    for (i, a) in args.iter().enumerate() {
        if let Some(v) = a.strip_prefix(&format!("{name}=")) {
            return Some(v.to_string());
        }
        if *a == name {
            return args.get(i + 1).map(|s| s.to_string());
        }
    }
    None
}

#[test]
fn gateway_inference_manifests_reference_each_other() {
    let dir = deploy_dir().join("kubernetes");
    let (mut docs, mut patches) = (Vec::new(), Vec::new());
    load_kustomization(&dir, &mut docs, &mut patches);

    // The Thaw Deployments: GPU, /health probes, adapters from a volume.
    let thaw: Vec<&Value> = of_kind(&docs, "Deployment")
        .into_iter()
        .filter(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .is_some_and(|cs| cs.iter().any(|c| c["name"] == "thaw"))
        })
        .collect();
    assert!(thaw.len() >= 2, "the pool has at least two Thaw instances");
    let mut thaw_port = None;
    for d in &thaw {
        let pod_labels = labels(&d["spec"]["template"]["metadata"]["labels"]);
        assert!(selects(
            &labels(&d["spec"]["selector"]["matchLabels"]),
            &pod_labels
        ));
        let c = container(d, "thaw");
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], 1);
        for probe in ["readinessProbe", "livenessProbe"] {
            let g = &c[probe]["httpGet"];
            assert_eq!(g["path"], "/health", "{probe}");
            let p = resolve_port(c, &g["port"]);
            assert_eq!(Some(p), flag(c, "--port").and_then(|s| s.parse().ok()));
            thaw_port = Some(p);
        }
        let lora_dir = flag(c, "--lora-dir").expect("--lora-dir");
        let mount = c["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == lora_dir.as_str())
            .expect("the adapter directory is a mounted volume");
        let vol = d["spec"]["template"]["spec"]["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .expect("the adapter volume is defined");
        assert!(vol["persistentVolumeClaim"]["claimName"].is_string());
    }

    // The API-key patch targets exactly the Thaw Deployments and reads the README's Secret.
    assert_eq!(patches.len(), 1);
    let (target, patch) = &patches[0];
    assert_eq!(target["kind"], "Deployment");
    let (k, v) = target["labelSelector"]
        .as_str()
        .and_then(|s| s.split_once('='))
        .expect("labelSelector k=v");
    let sel = BTreeMap::from([(k.to_string(), v.to_string())]);
    for d in of_kind(&docs, "Deployment") {
        let is_thaw = thaw.iter().any(|t| std::ptr::eq(*t, d));
        assert_eq!(selects(&sel, &labels(&d["metadata"]["labels"])), is_thaw);
    }
    let env = container(patch, "thaw")["env"].as_sequence().unwrap();
    let key = env
        .iter()
        .find(|e| e["name"] == "THAW_API_KEY")
        .expect("THAW_API_KEY");
    let secret = &key["valueFrom"]["secretKeyRef"];
    let readme = std::fs::read_to_string(deploy_dir().join("README.md")).unwrap();
    let create = format!(
        "kubectl create secret generic {} --from-literal={}=",
        secret["name"].as_str().unwrap(),
        secret["key"].as_str().unwrap()
    );
    assert!(readme.contains(&create), "README lacks `{create}`");

    // The pool selects the Thaw pods on their http port and names the EPP's Service.
    let pool = of_kind(&docs, "InferencePool");
    assert_eq!(pool.len(), 1);
    let pool = pool[0];
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let pool_name = pool["metadata"]["name"].as_str().unwrap();
    let pool_sel = labels(&pool["spec"]["selector"]["matchLabels"]);
    for d in &thaw {
        assert!(selects(
            &pool_sel,
            &labels(&d["spec"]["template"]["metadata"]["labels"])
        ));
    }
    assert_eq!(pool["spec"]["targetPorts"][0]["number"].as_u64(), thaw_port);
    let picker = &pool["spec"]["endpointPickerRef"];
    let epp_svc = find(&docs, "Service", picker["name"].as_str().unwrap());
    let svc_port = epp_svc["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["port"] == picker["port"]["number"])
        .expect("the EPP Service has the pool's picker port");

    // The EPP: selected by its Service, serving this pool on that port, config mounted.
    let epp = of_kind(&docs, "Deployment")
        .into_iter()
        .find(|d| {
            selects(
                &labels(&epp_svc["spec"]["selector"]),
                &labels(&d["spec"]["template"]["metadata"]["labels"]),
            )
        })
        .expect("the EPP Service selects a Deployment");
    let c = container(epp, "epp");
    let image = c["image"].as_str().unwrap();
    assert!(
        image.starts_with("registry.k8s.io/gateway-api-inference-extension/epp:v"),
        "a released EPP image, pinned: {image}"
    );
    assert_eq!(flag(c, "--pool-name").as_deref(), Some(pool_name));
    let grpc = resolve_port(c, &svc_port["targetPort"]);
    assert_eq!(Some(grpc.to_string()), flag(c, "--grpc-port"));
    let health: u64 = flag(c, "--grpc-health-port").unwrap().parse().unwrap();
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["grpc"]["port"].as_u64(), Some(health));
    }
    let cfg_path = flag(c, "--config-file").expect("--config-file");
    let (cfg_dir, cfg_file) = cfg_path.rsplit_once('/').unwrap();
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == cfg_dir)
        .expect("the config directory is mounted");
    let vol = epp["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let cm = find(
        &docs,
        "ConfigMap",
        vol["configMap"]["name"].as_str().unwrap(),
    );
    let plugins: Value =
        serde_yaml::from_str(cm["data"][cfg_file].as_str().expect("config file in map")).unwrap();
    assert_eq!(plugins["kind"], "EndpointPickerConfig");
    let defined: Vec<&str> = plugins["plugins"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().or(p["type"].as_str()).unwrap())
        .collect();
    assert!(defined.contains(&"lora-affinity-scorer"));
    // Prefix-cache affinity (issue 28): the EPP v1.0 plugin with exactly its three parameters
    // (hashBlockSize, maxPrefixBlocksToMatch, lruCapacityPerServer; positive integers, or the
    // EPP falls back to its defaults or refuses the file), and a weight in every profile that
    // scores by it at least the load scorers' so affinity can win a tie-break on load.
    let prefix = plugins["plugins"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["type"] == "prefix-cache-scorer")
        .expect("the prefix-cache-scorer plugin is defined");
    let params = prefix["parameters"].as_mapping().expect("its parameters");
    let mut keys: Vec<&str> = params.keys().map(|k| k.as_str().unwrap()).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "hashBlockSize",
            "lruCapacityPerServer",
            "maxPrefixBlocksToMatch"
        ],
        "only the fields the EPP's prefix.Config reads"
    );
    for (k, v) in params {
        assert!(v.as_u64().is_some_and(|n| n > 0), "{k:?} = {v:?}");
    }
    let weight = |profile: &Value, name: &str| -> Option<u64> {
        profile["plugins"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|r| r["pluginRef"] == name)
            .map(|r| r["weight"].as_u64().unwrap_or(1))
    };
    let profiles = plugins["schedulingProfiles"].as_sequence().unwrap();
    let prefix_name = prefix["name"].as_str().or(prefix["type"].as_str()).unwrap();
    assert!(profiles.iter().any(|p| weight(p, prefix_name).is_some()));
    for p in profiles {
        if let Some(w) = weight(p, prefix_name) {
            for load in ["queue-scorer", "kv-cache-utilization-scorer"] {
                assert!(
                    w >= weight(p, load).unwrap_or(0),
                    "{load} outweighs prefix affinity"
                );
            }
        }
    }
    for profile in plugins["schedulingProfiles"].as_sequence().unwrap() {
        for r in profile["plugins"].as_sequence().unwrap() {
            let name = r["pluginRef"].as_str().unwrap();
            assert!(
                defined.contains(&name),
                "profile names undefined plugin {name}"
            );
        }
    }

    // Its service account exists and its roles are bound to it.
    let sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    find(&docs, "ServiceAccount", sa);
    let mut pool_readable = false;
    for kind in ["RoleBinding", "ClusterRoleBinding"] {
        for b in of_kind(&docs, kind) {
            assert!(b["subjects"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa));
            let role = find(
                &docs,
                b["roleRef"]["kind"].as_str().unwrap(),
                b["roleRef"]["name"].as_str().unwrap(),
            );
            pool_readable |= role["rules"].as_sequence().unwrap().iter().any(|r| {
                r["apiGroups"][0] == "inference.networking.k8s.io"
                    && r["resources"]
                        .as_sequence()
                        .unwrap()
                        .iter()
                        .any(|x| x.as_str() == Some("inferencepools"))
            });
        }
    }
    assert!(pool_readable, "the EPP may read InferencePools");

    // The route sends to the pool, from a Gateway that exists.
    let routes = of_kind(&docs, "HTTPRoute");
    assert_eq!(routes.len(), 1);
    let route = routes[0];
    for p in route["spec"]["parentRefs"].as_sequence().unwrap() {
        find(&docs, "Gateway", p["name"].as_str().unwrap());
    }
    let backends: Vec<&Value> = route["spec"]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|r| r["backendRefs"].as_sequence().unwrap())
        .collect();
    assert!(!backends.is_empty());
    for b in backends {
        assert_eq!(b["group"], "inference.networking.k8s.io");
        assert_eq!(b["kind"], "InferencePool");
        assert_eq!(b["name"], pool_name);
    }
}
