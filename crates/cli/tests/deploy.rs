//! The deployment files (`deploy/`) say what the binary accepts: every flag
//! and environment variable the Kubernetes manifest and the compose example
//! give `forkbox serve` is one `forkbox serve --help` documents, each node is
//! a cluster node on a database and a bucket, has /dev/kvm, and is probed on
//! `/healthz` (liveness) and `/readyz` (readiness). (No Kubernetes or Docker
//! runs here: the cluster itself is tested in `cluster.rs` with the same flags.)
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::process::Command;

use serde::Deserialize;
use yaml_serde::Value;

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn serve_help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_forkbox")).args(["serve", "--help"]).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect()
}

/// Every `--flag` of `args` is one `forkbox serve` documents; the cluster flags are there.
fn check_serve_args(args: &[String], help: &str) {
    assert_eq!(args[0], "serve", "{args:?}");
    for a in args.iter().filter(|a| a.starts_with("--")) {
        assert!(help.contains(&format!("{a} ")) || help.contains(&format!("{a}\n")), "`forkbox serve` has no {a}");
    }
    for needed in ["--node-id", "--advertise-url", "--objects"] {
        assert!(args.iter().any(|a| a == needed), "{needed} missing from {args:?}");
    }
}

#[test]
fn the_kubernetes_manifest_runs_cluster_nodes_with_kvm_and_probes() {
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/forkbox.yaml")).unwrap();
    let docs: Vec<Value> = yaml_serde::Deserializer::from_str(&text).map(|d| Value::deserialize(d).unwrap()).collect();
    let kind = |k: &str| docs.iter().filter(move |d| d["kind"] == k).cloned().collect::<Vec<_>>();
    let help = serve_help();
    let sts = kind("StatefulSet").pop().expect("a StatefulSet");
    let pod = &sts["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    check_serve_args(&strs(&c["args"]), &help);
    // Cluster mode, the database and the bucket come from the ConfigMap and the Secret.
    let config = kind("ConfigMap").pop().unwrap();
    let secret = kind("Secret").pop().unwrap();
    assert_eq!(config["data"]["FORKBOX_CLUSTER"], "true");
    assert!(secret["stringData"]["FORKBOX_DATABASE_URL"].as_str().unwrap().starts_with("postgres://"));
    assert!(config["data"]["FORKBOX_OBJECTS"].as_str().unwrap().starts_with("s3://"));
    for env in ["FORKBOX_CLUSTER", "FORKBOX_DATABASE_URL"] {
        assert!(help.contains(env), "`forkbox serve --help` does not name ${env}");
    }
    // /dev/kvm from the host, privileged (the workers' jail), on KVM machines.
    let kvm = pod["volumes"].as_sequence().unwrap().iter().find(|v| v["name"] == "kvm").unwrap();
    assert_eq!(
        (&kvm["hostPath"]["path"], &kvm["hostPath"]["type"]),
        (&Value::from("/dev/kvm"), &Value::from("CharDevice"))
    );
    assert!(c["volumeMounts"].as_sequence().unwrap().iter().any(|m| m["mountPath"] == "/dev/kvm"));
    assert_eq!(c["securityContext"]["privileged"], true);
    assert_eq!(pod["nodeSelector"]["forkbox.dev/kvm"], "true");
    // Liveness on /healthz, readiness on /readyz (503 while draining).
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    // A Service in front of the nodes.
    assert!(kind("Service")
        .iter()
        .any(|s| s["spec"]["selector"]["app"] == "forkbox" && s["spec"]["clusterIP"].is_null()));
}

#[test]
fn the_compose_example_runs_three_cluster_nodes() {
    let text = std::fs::read_to_string(repo().join("deploy/compose/compose.yaml")).unwrap();
    let doc: Value = yaml_serde::from_str(&text).unwrap();
    let help = serve_help();
    let services = doc["services"].as_mapping().unwrap();
    let nodes: Vec<&Value> =
        services.iter().filter(|(k, _)| k.as_str().unwrap().starts_with("node-")).map(|(_, v)| v).collect();
    assert_eq!(nodes.len(), 3);
    for n in nodes {
        check_serve_args(&strs(&n["command"]), &help);
    }
    let anchor = &doc["x-node"];
    assert_eq!(anchor["environment"]["FORKBOX_CLUSTER"], "true");
    assert!(strs(&anchor["devices"]).iter().any(|d| d.starts_with("/dev/kvm")));
}
