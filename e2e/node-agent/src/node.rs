//! The Node object, its status heartbeat and its Lease in kube-node-lease.
//! Only requests the Node authorizer and NodeRestriction allow a node: create
//! of its own Node, PATCH of nodes/status (never GET of it), and its own
//! Lease.

use std::time::Duration;

use anyhow::Context;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;
use tracing::{info, warn};

pub const LEASE_SECONDS: i32 = 40;
pub const RENEW_EVERY: Duration = Duration::from_secs(10);

fn memory_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(4 * 1024 * 1024)
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The node's status (capacity, conditions, addresses, info) as the body
/// of a merge patch of nodes/status. `since` is when the agent came up (the
/// conditions' lastTransitionTime).
pub fn node_status(name: &str, since: Timestamp, now: Timestamp) -> serde_json::Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let resources = json!({
        "cpu": cpus.to_string(),
        "memory": format!("{}Ki", memory_kib()),
        "pods": "110",
        "ephemeral-storage": "100Gi",
    });
    let cond = |ty: &str, status: &str, reason: &str, message: &str| {
        json!({
            "type": ty, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": Time(now), "lastTransitionTime": Time(since),
        })
    };
    let kernel = read_trim("/proc/sys/kernel/osrelease");
    json!({
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "weir node agent: no memory pressure tracking"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "weir node agent: no disk pressure tracking"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "weir node agent: no PID pressure tracking"),
                cond("Ready", "True", "KubeletReady", "weir node agent is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": read_trim("/etc/machine-id"),
                "systemUUID": read_trim("/etc/machine-id"),
                "bootID": read_trim("/proc/sys/kernel/random/boot_id"),
                "kernelVersion": kernel,
                "osImage": "weir node agent (local processes)",
                "containerRuntimeVersion": "weir-process://0.1.0",
                "kubeletVersion": "v1.36.0-weir-node-agent",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": std::env::consts::ARCH.replace("x86_64", "amd64").replace("aarch64", "arm64"),
            },
        }
    })
}

/// Create the Node if it does not exist (a second agent run re-uses it).
pub async fn register(client: &Client, name: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let arch = std::env::consts::ARCH
        .replace("x86_64", "amd64")
        .replace("aarch64", "arm64");
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": arch,
                "beta.kubernetes.io/os": "linux",
                "beta.kubernetes.io/arch": arch,
            },
        },
        "spec": {},
    }))?;
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => info!(node = name, "registered node"),
        Err(kube::Error::Api(e)) if e.code == 409 => info!(node = name, "node exists; re-using it"),
        Err(e) => return Err(e).context("creating the Node"),
    }
    Ok(())
}

pub async fn patch_status(client: &Client, name: &str, since: Timestamp) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(node_status(name, since, Timestamp::now())),
        )
        .await
        .context("patching nodes/status")?;
    Ok(())
}

/// Renew (or create) the node's Lease.
pub async fn renew_lease(
    client: &Client,
    name: &str,
    node_uid: Option<&str>,
) -> anyhow::Result<()> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let spec = json!({
        "holderIdentity": name,
        "leaseDurationSeconds": LEASE_SECONDS,
        "renewTime": MicroTime(Timestamp::now()),
    });
    match leases
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": spec })),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            let mut meta = json!({ "name": name, "namespace": "kube-node-lease" });
            if let Some(uid) = node_uid {
                meta["ownerReferences"] =
                    json!([{ "apiVersion": "v1", "kind": "Node", "name": name, "uid": uid }]);
            }
            let lease: Lease = serde_json::from_value(json!({ "metadata": meta, "spec": spec }))?;
            leases
                .create(&PostParams::default(), &lease)
                .await
                .context("creating the node Lease")?;
            info!(node = name, "created lease kube-node-lease/{name}");
            Ok(())
        }
        Err(e) => Err(e).context("renewing the node Lease"),
    }
}

/// Register, then keep the Lease and the Ready heartbeat fresh forever.
pub async fn run(client: Client, name: String) -> anyhow::Result<()> {
    register(&client, &name).await?;
    let since = Timestamp::now();
    let nodes: Api<Node> = Api::all(client.clone());
    let uid = nodes.get(&name).await.ok().and_then(|n| n.metadata.uid);
    loop {
        if let Err(e) = patch_status(&client, &name, since).await {
            warn!("node status heartbeat failed: {e:#}");
        }
        if let Err(e) = renew_lease(&client, &name, uid.as_deref()).await {
            warn!("lease renewal failed: {e:#}");
        }
        tokio::time::sleep(RENEW_EVERY).await;
    }
}
