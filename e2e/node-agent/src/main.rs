//! weir-node-agent: a kubelet stand-in for e2e tests on machines without a
//! container runtime. Registers a Node, keeps its Lease fresh, and runs the
//! pods bound to it as local processes (see e2e/README.md, "The node agent").

mod env;
mod image;
mod ipalloc;
mod node;
mod pod;
mod probe;
mod status;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tracing::{error, info, warn};

#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("the kubeconfig's server URL {0} names no port")]
    NoPort(String),
}

// One thread: children get PR_SET_PDEATHSIG, which fires when the thread
// that forked them exits; with a single thread that is the agent's exit.
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("{}", include_str!("help.txt"));
        return Ok(());
    }
    let node_name = std::env::var("WEIR_NODE_NAME").unwrap_or_else(|_| "weir-node".into());
    let config = kube::Config::infer()
        .await
        .context("loading the kubeconfig (KUBECONFIG)")?;
    let url = config.cluster_url.clone();
    let apiserver_port = url
        .port_u16()
        .or_else(|| (url.scheme_str() == Some("https")).then_some(443))
        .ok_or_else(|| StartError::NoPort(url.to_string()))?;
    let client = Client::try_from(config)?;
    let images = image::ImageMap::from_env().map_err(anyhow::Error::msg)?;
    let base = std::env::var("WEIR_CLUSTER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir().join(format!("weir-node-agent-{node_name}")));
    let pods_dir = base.join("pods");
    std::fs::create_dir_all(&pods_dir)
        .with_context(|| format!("creating {}", pods_dir.display()))?;
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    let mount_ns = root
        && std::env::var("WEIR_NODE_AGENT_MOUNT_NS").map_or(true, |v| v != "0")
        && std::process::Command::new("unshare")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if !mount_ns {
        warn!("no private mount namespaces (needs root and unshare): volumes are not mounted at their paths");
    }
    info!(node = %node_name, apiserver_port, pods_dir = %pods_dir.display(), mount_ns, "weir node agent starting");
    let shared = Arc::new(pod::Shared {
        client: client.clone(),
        node_name: node_name.clone(),
        apiserver_port,
        images,
        ips: Mutex::new(ipalloc::IpAlloc::default()),
        pods_dir,
        pgids: Mutex::new(HashSet::new()),
        mount_ns,
        created: pod::MountPoints::default(),
    });

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let node_task = tokio::spawn(node::run(client.clone(), node_name.clone()));
    let result = tokio::select! {
        r = node_task => match r {
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Ok(()),
            Err(e) => Err(e.into()),
        },
        r = watch_pods(shared.clone(), client, node_name) => r,
        _ = term.recv() => { info!("SIGTERM: stopping"); Ok(()) }
        _ = int.recv() => { info!("SIGINT: stopping"); Ok(()) }
    };
    shared.kill_all();
    shared.created.remove_all();
    if let Err(e) = &result {
        error!("{e:#}");
    }
    result
}

/// Watch the pods bound to this node; one task per pod (by uid), fed the
/// latest version of its object. Dropping a pod's sender tells its task the
/// object is gone.
async fn watch_pods(
    shared: Arc<pod::Shared>,
    client: Client,
    node_name: String,
) -> anyhow::Result<()> {
    let api: Api<Pod> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
    let mut stream = watcher::watcher(api, cfg).default_backoff().boxed();
    let mut pods: HashMap<String, watch::Sender<Pod>> = HashMap::new();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                warn!("pod watch: {e}");
                continue;
            }
        };
        match ev {
            Event::Init => listed.clear(),
            Event::InitApply(p) | Event::Apply(p) => {
                let Some(uid) = p.metadata.uid.clone() else {
                    continue;
                };
                listed.insert(uid.clone());
                match pods.get(&uid) {
                    Some(tx) => {
                        tx.send_replace(p);
                    }
                    None => {
                        let (tx, rx) = watch::channel(p);
                        pods.insert(uid, tx);
                        tokio::spawn(pod::run(shared.clone(), rx));
                    }
                }
            }
            Event::InitDone => {
                // Pods that went away while the watch was down.
                pods.retain(|uid, _| listed.contains(uid));
            }
            Event::Delete(p) => {
                if let Some(uid) = p.metadata.uid {
                    pods.remove(&uid);
                    listed.remove(&uid);
                }
            }
        }
    }
    anyhow::bail!("the pod watch ended")
}
