//! `weir-controller`: the weir operator binary.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{reflector, watcher, Controller, WatchStreamExt};
use kube::{Api, Client};
use tracing::{error, info, warn};
use weir_api::streamjob::StreamJob;
use weir_controller::context::Context;
use weir_controller::desired::{NetworkPolicySettings, WorkerSettings};
use weir_controller::metrics::Metrics;
use weir_controller::pod_cache::PodCache;
use weir_controller::worker_api::HttpWorkerApi;
use weir_controller::{names, reconcile, server};

/// The weir operator: runs StreamJobs as worker pods, takes savepoints before
/// upgrades, restores jobs after pod failures, and reports progress in status.
#[derive(Parser, Debug)]
#[command(name = "weir-controller", version)]
struct Cli {
    /// Watch StreamJobs in this namespace only (default: all namespaces).
    #[arg(long, env = "WEIR_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Address of the /metrics, /healthz and /readyz endpoint: IP (port 8080),
    /// IP:PORT or [IPv6]:PORT; the chart passes the pod's IP alone, which works
    /// for IPv4 and IPv6 pods alike.
    #[arg(long, default_value = "0.0.0.0:8080", value_parser = parse_metrics_addr)]
    metrics_addr: SocketAddr,
    /// Reconcile only while holding a Lease, so that several replicas can run.
    #[arg(long)]
    leader_election: bool,
    /// Namespace of the leader Lease (default: POD_NAMESPACE, else "default").
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = "weir-controller")]
    lease_name: String,
    /// The Secret holding the operator's control key, in the operator's
    /// namespace (POD_NAMESPACE, else "default"); created with a random key
    /// if missing. Every job's control token is derived from it, so the
    /// operator never reads the Secrets of job namespaces.
    #[arg(long, env = "WEIR_CONTROL_KEY_SECRET", default_value = "weir-control-key")]
    control_key_secret: String,
    /// The CA certificates (PEM) the workers' certificates of jobs with
    /// spec.tls must lead to (the chart mounts workerTls.caConfigMap here).
    /// Without it, jobs with spec.tls are refused (reason NoWorkerCA).
    #[arg(long, env = "WEIR_WORKER_CA_FILE", value_name = "PEM")]
    worker_ca_file: Option<std::path::PathBuf>,
    /// ServiceAccount of worker pods whose StreamJob names none
    /// (default: the namespace's default account; workers never call the API).
    #[arg(long)]
    worker_service_account: Option<String>,
    /// The worker image of StreamJobs that set no spec.image (e.g.
    /// registry.example.com/weir:0.1.0). Without it such jobs are not started.
    #[arg(long, env = "WEIR_DEFAULT_WORKER_IMAGE")]
    default_worker_image: Option<String>,
    /// runAsUser, runAsGroup and fsGroup of worker pods, or `auto` to leave
    /// them to the platform (OpenShift assigns each namespace a UID range).
    #[arg(long, env = "WEIR_WORKER_UID", default_value = "65532", value_parser = parse_uid)]
    worker_uid: WorkerUid,
    /// Give every job a NetworkPolicy: the workers' control port only from
    /// pods with --operator-pod-labels in the operator's namespace
    /// (POD_NAMESPACE), their data and coordinator ports only from the job's own workers.
    #[arg(long, env = "WEIR_WORKER_NETWORK_POLICY")]
    worker_network_policy: bool,
    /// The labels of the operator's pods (k=v,k=v), for --worker-network-policy.
    #[arg(long, env = "WEIR_OPERATOR_POD_LABELS", value_parser = parse_labels, requires = "worker_network_policy")]
    operator_pod_labels: Option<BTreeMap<String, String>>,
    /// At most this many StreamJobs upgrade at once (savepoint, new pods,
    /// restore); others whose spec changed keep running their previous spec
    /// until a slot is free (status: UpgradeQueued). 0: no limit.
    #[arg(long, env = "WEIR_MAX_CONCURRENT_UPGRADES", default_value_t = 0)]
    max_concurrent_upgrades: usize,
    /// Log format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(&cli.log_format);
    let client = Client::try_default().await.context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let health = server::Health { metrics: metrics.clone(), ready: ready.clone() };
    let addr = cli.metrics_addr;
    tokio::spawn(async move {
        if let Err(e) = server::serve(addr, health).await {
            error!(error = %e, %addr, "metrics endpoint stopped");
            std::process::exit(1);
        }
    });
    let version = client.apiserver_version().await.context("asking the API server for its version")?;
    info!(server = %version.git_version, namespace = cli.namespace.as_deref().unwrap_or("(all)"), "connected");
    let own_namespace = cli.lease_namespace.clone().unwrap_or_else(|| "default".into());
    let control_key = weir_controller::control_key::load_or_create(client.clone(), &own_namespace, &cli.control_key_secret)
        .await
        .context("loading the control key (--control-key-secret)")?;
    ready.store(true, Ordering::Relaxed);

    let mut leadership = None;
    if cli.leader_election {
        let identity = std::env::var("POD_NAME").unwrap_or_else(|_| format!("weir-controller-{}", std::process::id()));
        let ns = own_namespace.clone();
        let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &cli.lease_name)
            .with_namespace(&ns)
            .with_identity(&identity)
            .with_duration(15)
            .with_grace(5)
            .build()
            .await
            .context("setting up leader election")?;
        let (mut rx, task) = manager.watch().await;
        info!(lease = %cli.lease_name, namespace = %ns, %identity, "waiting for the leader lease");
        // A standby replica waits here, possibly for ever: a SIGTERM (helm
        // uninstall, a rolling update) must end it at once rather than after
        // the pod's grace period.
        let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("installing the SIGTERM handler")?;
        while !*rx.borrow_and_update() {
            tokio::select! {
                changed = rx.changed() => changed.context("leader election stopped")?,
                _ = sigterm.recv() => { info!("stopped by SIGTERM while waiting for the leader lease"); return Ok(()); }
                _ = tokio::signal::ctrl_c() => { info!("stopped by SIGINT while waiting for the leader lease"); return Ok(()); }
            }
        }
        info!("leading");
        metrics.leader.set(1);
        leadership = Some((rx, task));
    } else {
        metrics.leader.set(1);
    }

    let (jobs, pods): (Api<StreamJob>, Api<Pod>) = match &cli.namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let instance = std::env::var("POD_NAME").ok();
    let network_policy = match (cli.worker_network_policy, &cli.operator_pod_labels) {
        (false, _) => None,
        (true, Some(labels)) => Some(NetworkPolicySettings {
            namespace: std::env::var("POD_NAMESPACE").ok().filter(|n| !n.is_empty()).context("--worker-network-policy needs POD_NAMESPACE (the operator's namespace)")?,
            pod_labels: labels.clone(),
        }),
        (true, None) => anyhow::bail!("--worker-network-policy needs --operator-pod-labels (the labels of the operator's pods)"),
    };
    let mut workers = HttpWorkerApi::new()?;
    if let Some(ca) = &cli.worker_ca_file {
        workers = workers.with_worker_ca(ca)?;
        info!(ca = %ca.display(), "jobs with spec.tls are called over HTTPS, their certificates checked against this CA");
    }
    let settings = WorkerSettings {
        worker_ca: workers.trusts_worker_ca(),
        service_account: cli.worker_service_account.clone(),
        default_image: cli.default_worker_image.clone().filter(|i| !i.is_empty()),
        uid: cli.worker_uid.0,
        network_policy,
        // Set with the key, below.
        control_key_id: None,
    };
    match &settings.default_image {
        Some(image) => info!(%image, "default worker image"),
        None => warn!("no --default-worker-image: StreamJobs without spec.image are not started"),
    }
    // One watch of the jobs' pods both fills the pod cache reconciles read
    // and triggers them (the cache is updated before the trigger fires). Only
    // what observing a pod needs is kept: metadata without managedFields,
    // status, and of the spec only the node (lost nodes are avoided by it)
    // and the worker's TLS name (its control endpoint is HTTPS then).
    let pod_cache = Arc::new(PodCache::default());
    let cache = pod_cache.clone();
    let pod_events = watcher(pods, watcher::Config::default().labels(names::JOB_LABEL))
        .modify(|pod| {
            pod.spec = pod.spec.take().map(|s| k8s_openapi::api::core::v1::PodSpec {
                node_name: s.node_name,
                containers: s.containers.into_iter().filter(|c| c.name == weir_controller::desired::WORKER_CONTAINER).map(tls_args_only).collect(),
                ..Default::default()
            });
            pod.metadata.managed_fields = None;
        })
        .inspect(move |event| {
            if let Ok(event) = event {
                cache.apply(event);
            }
        })
        .touched_objects();
    // The jobs' cache without managedFields, which nothing here reads (the
    // entries of kubectl, the operator's status and finalizer writes were
    // about two thirds of the memory the cached StreamJobs took: heaptrack,
    // 1000 jobs, 24 MB → 9 MB).
    let (job_cache, job_writer) = reflector::store();
    let job_events = watcher(jobs, watcher::Config::default())
        .modify(|job| job.metadata.managed_fields = None)
        .reflect(job_writer)
        .applied_objects();
    let mut ctx = Context::new(client.clone(), Arc::new(workers), metrics, settings, instance).with_pod_cache(pod_cache).with_control_key(control_key);
    if cli.max_concurrent_upgrades > 0 {
        info!(limit = cli.max_concurrent_upgrades, "at most this many jobs upgrade at once");
        ctx = ctx.with_upgrade_limit(cli.max_concurrent_upgrades, job_cache.clone());
    }
    let ctx = Arc::new(ctx);
    let controller = Controller::for_stream(job_events, job_cache)
        .owns_stream(pod_events)
        .shutdown_on_signal()
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "reconcile ended with an error");
            }
        });
    match leadership {
        None => controller.await,
        Some((mut rx, task)) => {
            tokio::select! {
                _ = controller => {}
                _ = async { while rx.changed().await.is_ok() { if !*rx.borrow() { break; } } } => {
                    // Another replica may act now: stop at once rather than race it.
                    warn!("lost the leader lease; exiting so that the new leader alone acts");
                    std::process::exit(1);
                }
            }
            // Stopped by a signal (a rolling update, a deleted pod): closing the
            // channel makes the lease task release the lease, so that a standby
            // replica takes over now instead of after the lease expires. The
            // controller has stopped, so nothing here acts any more.
            drop(rx);
            match tokio::time::timeout(std::time::Duration::from_secs(5), task).await {
                Ok(Ok(Ok(_))) => info!("released the leader lease"),
                Ok(Ok(Err(e))) => warn!(error = %e, "could not release the leader lease; it expires by itself"),
                Ok(Err(e)) => warn!(error = %e, "the leader lease task failed; the lease expires by itself"),
                Err(_) => warn!("releasing the leader lease took over 5 s; it expires by itself"),
            }
        }
    }
    info!("stopped");
    Ok(())
}

/// `--worker-uid`: a UID, or `None` for `auto`.
#[derive(Debug, Clone, Copy)]
struct WorkerUid(Option<i64>);

fn parse_uid(text: &str) -> Result<WorkerUid, String> {
    if text == "auto" {
        return Ok(WorkerUid(None));
    }
    match text.parse::<i64>() {
        Ok(uid) if uid > 0 => Ok(WorkerUid(Some(uid))),
        _ => Err(format!("{text:?}: expected a UID above 0 (worker pods never run as root) or `auto`")),
    }
}

fn parse_metrics_addr(text: &str) -> Result<SocketAddr, String> {
    weir_api::control::parse_listen_addr(text, 8080)
}

/// `k=v,k=v` as a map; an empty key or a pair without `=` is refused.
fn parse_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
            _ => Err(format!("{pair:?}: expected key=value")),
        })
        .collect::<Result<BTreeMap<_, _>, _>>()
        .and_then(|m| if m.is_empty() { Err("expected at least one key=value".into()) } else { Ok(m) })
}

fn init_tracing(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// The worker container as the pod cache keeps it: its name and, of its
/// arguments, only `--tls-server-name NAME`, which says how to call it.
fn tls_args_only(c: k8s_openapi::api::core::v1::Container) -> k8s_openapi::api::core::v1::Container {
    let args = c.args.unwrap_or_default();
    let tls: Vec<String> = args.iter().position(|a| a == "--tls-server-name").map(|i| args[i..(i + 2).min(args.len())].to_vec()).unwrap_or_default();
    k8s_openapi::api::core::v1::Container { name: c.name, args: (!tls.is_empty()).then_some(tls), ..Default::default() }
}
