//! One task per pod bound to the node: runs its containers as local
//! processes, reports their status, restarts them per restartPolicy and
//! honours deletion.

use std::collections::{BTreeMap, HashSet};
use std::net::Ipv4Addr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, DownwardAPIVolumeFile, KeyToPath, Pod, Secret, ServiceAccount,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::Client;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::env::{self, PodContext, Refs};
use crate::image::{container_argv, ImageMap};
use crate::ipalloc::IpAlloc;
use crate::probe::{self, Kind, ProbeEvent};
use crate::status::{build_status, exit_reason, CState, Ctr, RestartPolicy, StatusInput};

pub const HOST_IP: &str = "127.0.0.1";

/// What all pod tasks share.
pub struct Shared {
    pub client: Client,
    pub node_name: String,
    pub apiserver_port: u16,
    pub images: ImageMap,
    pub ips: Mutex<IpAlloc>,
    /// Per-pod directories (volumes, logs) live here.
    pub pods_dir: PathBuf,
    /// Process groups of running containers, killed when the agent stops.
    pub pgids: Mutex<HashSet<i32>>,
    /// Private mount namespace per container (needs root and `unshare`).
    pub mount_ns: bool,
    /// Mount points the agent had to create on the host's filesystem (a
    /// mount namespace isolates mounts, not directories); removed, if
    /// still empty, when the agent stops.
    pub created: MountPoints,
}

impl Shared {
    pub fn kill_all(&self) {
        for pgid in self.pgids.lock().unwrap().drain() {
            signal_group(pgid, libc::SIGKILL);
        }
    }
}

/// Mount points the agent created on the host.
#[derive(Default)]
pub struct MountPoints(Mutex<Vec<PathBuf>>);

impl MountPoints {
    /// Create a mount point (directory, or empty file for a file source)
    /// and its missing ancestors, remembering what did not exist before.
    pub fn ensure(&self, dst: &Path, file: bool) -> std::io::Result<()> {
        let mut missing = Vec::new();
        let mut p = Some(dst);
        while let Some(d) = p {
            if d.symlink_metadata().is_ok() {
                break;
            }
            missing.push(d.to_path_buf());
            p = d.parent();
        }
        if file {
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent)?;
            }
            if !dst.exists() {
                std::fs::File::create(dst)?;
            }
        } else {
            std::fs::create_dir_all(dst)?;
        }
        self.0.lock().unwrap().extend(missing);
        Ok(())
    }

    /// Remove the mount points the agent created, deepest first, each only
    /// if it is an empty directory or an empty file.
    pub fn remove_all(&self) {
        let mut created = std::mem::take(&mut *self.0.lock().unwrap());
        created.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        created.dedup();
        for p in created {
            match p.symlink_metadata() {
                Ok(m) if m.is_dir() => {
                    let _ = std::fs::remove_dir(&p);
                }
                Ok(m) if m.is_file() && m.len() == 0 => {
                    let _ = std::fs::remove_file(&p);
                }
                _ => {}
            }
        }
    }
}

fn signal_group(pgid: i32, sig: i32) {
    // SAFETY: plain syscall; a negative pid addresses the process group.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Restart backoff: 1 s doubling to 20 s (the kubelet's 10 s .. 5 min is too
/// slow for tests); reset after a run of 30 s.
fn backoff(consecutive_failures: u32) -> Duration {
    Duration::from_secs((1u64 << consecutive_failures.min(5)).min(20))
}

struct Running {
    seq: u64,
    pid: i32,
    started: Timestamp,
    since: Instant,
    probes: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for p in &self.probes {
            p.abort();
        }
    }
}

struct CtrRt {
    spec: Container,
    status: Ctr,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    run: Option<Running>,
    next_start: Option<Instant>,
    failures: u32,
}

struct Exit {
    idx: usize,
    seq: u64,
    code: i32,
}

pub struct PodTask {
    sh: Arc<Shared>,
    api: Api<Pod>,
    pod: Pod,
    ns: String,
    name: String,
    uid: String,
    dir: PathBuf,
    ip: Option<Ipv4Addr>,
    start_time: Timestamp,
    policy: RestartPolicy,
    ctrs: Vec<CtrRt>,
    error: Option<(String, String)>,
    exit_tx: mpsc::UnboundedSender<Exit>,
    exit_rx: mpsc::UnboundedReceiver<Exit>,
    probe_tx: mpsc::UnboundedSender<ProbeEvent>,
    probe_rx: mpsc::UnboundedReceiver<ProbeEvent>,
    seq: u64,
    token_refresh: Option<Instant>,
}

fn is_deleting(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_some()
}

pub async fn run(sh: Arc<Shared>, rx: watch::Receiver<Pod>) {
    let pod = rx.borrow().clone();
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let (exit_tx, exit_rx) = mpsc::unbounded_channel();
    let (probe_tx, probe_rx) = mpsc::unbounded_channel();
    let policy = RestartPolicy::parse(pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()));
    let mut t = PodTask {
        api: Api::namespaced(sh.client.clone(), &ns),
        dir: sh.pods_dir.join(format!("{ns}_{name}_{uid}")),
        sh,
        pod,
        ns,
        name,
        uid,
        ip: None,
        start_time: Timestamp::now(),
        policy,
        ctrs: Vec::new(),
        error: None,
        exit_tx,
        exit_rx,
        probe_tx,
        probe_rx,
        seq: 0,
        token_refresh: None,
    };
    info!(pod = %t.key(), "pod bound to this node");
    t.main(rx).await;
    t.cleanup();
    info!(pod = %t.key(), "pod task done");
}

impl PodTask {
    fn key(&self) -> String {
        format!("{}/{}", self.ns, self.name)
    }

    fn ip_str(&self) -> String {
        self.ip.map(|i| i.to_string()).unwrap_or_default()
    }

    fn cleanup(&mut self) {
        for c in &mut self.ctrs {
            if let Some(r) = c.run.take() {
                signal_group(r.pid, libc::SIGKILL);
                self.sh.pgids.lock().unwrap().remove(&r.pid);
            }
        }
        if let Some(ip) = self.ip.take() {
            self.sh.ips.lock().unwrap().release(ip);
        }
        // Volumes go; logs stay for post-mortems (the state dir goes at `down`).
        let _ = std::fs::remove_dir_all(self.dir.join("volumes"));
    }

    async fn main(&mut self, mut rx: watch::Receiver<Pod>) {
        let phase = self
            .pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if phase == "Succeeded" || phase == "Failed" {
            // Finished before this agent saw it (an agent restart): only
            // deletion is left to handle.
            self.wait_for_deletion(&mut rx).await;
            return;
        }
        if is_deleting(&self.pod) {
            self.finish_deletion().await;
            return;
        }
        // Pod IP: keep one the pod already has (agent restart), else a new one.
        let existing = self
            .pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|s| s.parse::<Ipv4Addr>().ok());
        self.ip = match existing {
            Some(ip) if self.sh.ips.lock().unwrap().reserve(ip) => Some(ip),
            _ => self.sh.ips.lock().unwrap().allocate(),
        };
        if let Some(s) = &self.pod.status {
            if let Some(t) = &s.start_time {
                self.start_time = t.0;
            }
        }
        let spec = self.pod.spec.clone().unwrap_or_default();
        self.ctrs = spec
            .containers
            .iter()
            .map(|c| CtrRt {
                spec: c.clone(),
                status: Ctr {
                    name: c.name.clone(),
                    image: c.image.clone().unwrap_or_default(),
                    image_id: String::new(),
                    state: CState::Waiting {
                        reason: "ContainerCreating".into(),
                        message: None,
                    },
                    last: None,
                    restart_count: 0,
                    pid: None,
                    ready: false,
                },
                argv: Vec::new(),
                env: Vec::new(),
                run: None,
                next_start: None,
                failures: 0,
            })
            .collect();
        if self.ip.is_none() {
            self.fail(
                "OutOfPodIPs",
                "the node has no free loopback address left".into(),
            );
        } else if !spec.init_containers.as_ref().is_none_or(|v| v.is_empty()) {
            self.fail(
                "Unsupported",
                "init containers are not supported by the weir node agent".into(),
            );
        } else {
            self.resolve_images();
        }
        self.report().await;
        if self.error.is_none() {
            self.prepare(&mut rx).await;
            if self.error.is_some() {
                self.report().await;
            }
        }
        if self.error.is_some() {
            self.wait_for_deletion(&mut rx).await;
            return;
        }
        if rx.has_changed().is_err() {
            return;
        }
        for i in 0..self.ctrs.len() {
            self.start(i);
        }
        self.report().await;
        self.supervise(&mut rx).await;
    }

    fn fail(&mut self, reason: &str, message: String) {
        warn!(pod = %self.key(), reason, "{message}");
        for c in &mut self.ctrs {
            if matches!(c.status.state, CState::Waiting { .. }) {
                c.status.state = CState::Waiting {
                    reason: reason.into(),
                    message: Some(message.clone()),
                };
            }
        }
        self.error = Some((reason.into(), message));
    }

    fn resolve_images(&mut self) {
        let mut errors = Vec::new();
        for c in &mut self.ctrs {
            match self.sh.images.resolve(&c.status.image) {
                Ok(bin) if bin.exists() => {
                    c.status.image_id = format!("file://{}", bin.display());
                    c.argv = container_argv(
                        &bin,
                        c.spec.command.as_deref().unwrap_or(&[]),
                        c.spec.args.as_deref().unwrap_or(&[]),
                    );
                }
                Ok(bin) => errors.push(format!(
                    "container {:?}: image {:?} maps to {}, which does not exist (build it first)",
                    c.status.name,
                    c.status.image,
                    bin.display()
                )),
                Err(e) => errors.push(format!("container {:?}: {e}", c.status.name)),
            }
        }
        if !errors.is_empty() {
            self.fail("ErrImagePull", errors.join("; "));
        }
    }

    /// Fetch referenced ConfigMaps/Secrets, build env and volumes. Retries
    /// for up to 60 s (a Secret created just after its pod), then fails the
    /// pod with CreateContainerConfigError.
    async fn prepare(&mut self, rx: &mut watch::Receiver<Pod>) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let r = self.try_prepare().await;
            match r {
                Ok(()) => return,
                Err(e) if Instant::now() >= deadline => {
                    self.fail("CreateContainerConfigError", e);
                    return;
                }
                Err(e) => {
                    warn!(pod = %self.key(), "not ready to start yet (retrying): {e}");
                    for c in &mut self.ctrs {
                        c.status.state = CState::Waiting {
                            reason: "CreateContainerConfigError".into(),
                            message: Some(e.clone()),
                        };
                    }
                    self.report().await;
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                changed = rx.changed() => {
                    if changed.is_err() || is_deleting(&rx.borrow()) {
                        return;
                    }
                }
            }
        }
    }

    fn ctx(&self) -> PodContext {
        PodContext {
            pod_ip: self.ip_str(),
            host_ip: HOST_IP.into(),
            node_name: self.sh.node_name.clone(),
            apiserver_port: self.sh.apiserver_port,
        }
    }

    async fn fetch_refs(&self) -> Result<Refs, String> {
        let (cms, secrets) = env::referenced(&self.pod);
        let mut refs = Refs::default();
        let cm_api: Api<ConfigMap> = Api::namespaced(self.sh.client.clone(), &self.ns);
        for n in cms {
            match cm_api.get_opt(&n).await {
                Ok(Some(cm)) => {
                    let mut d = cm.data.unwrap_or_default();
                    for (k, v) in cm.binary_data.unwrap_or_default() {
                        d.insert(k, String::from_utf8_lossy(&v.0).into_owned());
                    }
                    refs.config_maps.insert(n, d);
                }
                Ok(None) => {}
                Err(e) => return Err(format!("getting configmap {n:?}: {e}")),
            }
        }
        let s_api: Api<Secret> = Api::namespaced(self.sh.client.clone(), &self.ns);
        for n in secrets {
            match s_api.get_opt(&n).await {
                Ok(Some(s)) => {
                    let d: BTreeMap<String, String> = s
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                        .chain(s.string_data.unwrap_or_default())
                        .collect();
                    refs.secrets.insert(n, d);
                }
                Ok(None) => {}
                Err(e) => return Err(format!("getting secret {n:?}: {e}")),
            }
        }
        Ok(refs)
    }

    async fn try_prepare(&mut self) -> Result<(), String> {
        let refs = self.fetch_refs().await?;
        self.write_volumes(&refs).await?;
        let hosts = hosts_file(&self.pod, &self.ip_str());
        write_atomic(&self.dir, "etc-hosts", hosts.as_bytes())?;
        let ctx = self.ctx();
        for i in 0..self.ctrs.len() {
            let env = env::container_env(&self.pod, &self.ctrs[i].spec, &ctx, &refs)
                .map_err(|e| format!("container {:?}: {e}", self.ctrs[i].status.name))?;
            let c = &mut self.ctrs[i];
            // $(VAR) in command/args, except the resolved binary path.
            let mut argv = env::expand_all(&c.argv, &env);
            if let (Some(a), Some(b)) = (argv.first_mut(), c.argv.first()) {
                a.clone_from(b);
            }
            c.argv = argv;
            c.env = env;
        }
        Ok(())
    }

    fn vol_dir(&self, name: &str) -> PathBuf {
        self.dir.join("volumes").join(name)
    }

    /// Source directory (or host path) of a volume.
    fn vol_src(&self, name: &str) -> PathBuf {
        let host = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == name))
            .and_then(|v| v.host_path.as_ref())
            .map(|h| PathBuf::from(&h.path));
        host.unwrap_or_else(|| self.vol_dir(name))
    }

    /// Write every volume's content under the pod's directory. Idempotent:
    /// run again to refresh tokens (emptyDirs are left as they are).
    async fn write_volumes(&mut self, refs: &Refs) -> Result<(), String> {
        let volumes = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.clone())
            .unwrap_or_default();
        let mut refresh: Option<i64> = None;
        for v in &volumes {
            let dir = self.vol_dir(&v.name);
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("creating {}: {e}", dir.display()))?;
            let mut files: Vec<(String, Vec<u8>)> = Vec::new();
            if v.empty_dir.is_some() || v.host_path.is_some() {
                continue;
            } else if let Some(cm) = &v.config_map {
                files.extend(keyed_files(
                    refs.config_maps.get(&cm.name),
                    cm.items.as_deref(),
                    cm.optional,
                    "configmap",
                    &cm.name,
                )?);
            } else if let Some(s) = &v.secret {
                let n = s.secret_name.clone().unwrap_or_default();
                files.extend(keyed_files(
                    refs.secrets.get(&n),
                    s.items.as_deref(),
                    s.optional,
                    "secret",
                    &n,
                )?);
            } else if let Some(d) = &v.downward_api {
                files.extend(self.downward_files(d.items.as_deref().unwrap_or(&[]))?);
            } else if let Some(p) = &v.projected {
                for src in p.sources.iter().flatten() {
                    if let Some(t) = &src.service_account_token {
                        let exp = t.expiration_seconds.unwrap_or(3600).max(600);
                        let token = self.token(t.audience.clone(), exp).await?;
                        files.push((t.path.clone(), token.into_bytes()));
                        refresh = Some(refresh.map_or(exp, |r| r.min(exp)));
                    }
                    if let Some(cm) = &src.config_map {
                        files.extend(keyed_files(
                            refs.config_maps.get(&cm.name),
                            cm.items.as_deref(),
                            cm.optional,
                            "configmap",
                            &cm.name,
                        )?);
                    }
                    if let Some(s) = &src.secret {
                        files.extend(keyed_files(
                            refs.secrets.get(&s.name),
                            s.items.as_deref(),
                            s.optional,
                            "secret",
                            &s.name,
                        )?);
                    }
                    if let Some(d) = &src.downward_api {
                        files.extend(self.downward_files(d.items.as_deref().unwrap_or(&[]))?);
                    }
                }
            } else {
                warn!(pod = %self.key(), volume = %v.name, "unsupported volume type: mounted as an empty directory");
            }
            for (rel, data) in files {
                write_atomic(&dir, &rel, &data)?;
            }
        }
        // Refresh tokens at 60 % of their lifetime.
        self.token_refresh =
            refresh.map(|s| Instant::now() + Duration::from_secs((s as u64) * 6 / 10));
        Ok(())
    }

    fn downward_files(
        &self,
        items: &[DownwardAPIVolumeFile],
    ) -> Result<Vec<(String, Vec<u8>)>, String> {
        let ctx = self.ctx();
        items
            .iter()
            .filter_map(|i| i.field_ref.as_ref().map(|f| (i, f)))
            .map(|(i, f)| {
                Ok((
                    i.path.clone(),
                    env::field_value(&self.pod, &ctx, &f.field_path)?.into_bytes(),
                ))
            })
            .collect()
    }

    /// A service-account token bound to this pod (TokenRequest; the Node
    /// authorizer allows it for pods bound to the node).
    async fn token(&self, audience: Option<String>, exp: i64) -> Result<String, String> {
        let sa = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let api: Api<ServiceAccount> = Api::namespaced(self.sh.client.clone(), &self.ns);
        let req = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: Some(audience.into_iter().filter(|a| !a.is_empty()).collect()),
                expiration_seconds: Some(exp),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(self.name.clone()),
                    uid: Some(self.uid.clone()),
                }),
            }),
            ..Default::default()
        };
        let tr = api
            .create_token_request(&sa, &PostParams::default(), &req)
            .await
            .map_err(|e| format!("token request for serviceaccount {sa:?}: {e}"))?;
        tr.status
            .and_then(|s| s.token)
            .ok_or_else(|| "token request returned no token".into())
    }

    /// Bind mounts for a container: (source, target, read-only).
    fn mounts(&self, c: &Container) -> Vec<(PathBuf, String, bool)> {
        c.volume_mounts
            .iter()
            .flatten()
            .map(|m| {
                let mut src = self.vol_src(&m.name);
                if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                    src = src.join(sub);
                }
                (src, m.mount_path.clone(), m.read_only.unwrap_or(false))
            })
            .chain(
                // The pod's own /etc/hosts (its name -> its IP), as the
                // kubelet provides, unless the container mounts one itself.
                (!c.volume_mounts
                    .iter()
                    .flatten()
                    .any(|m| m.mount_path == "/etc/hosts"))
                .then(|| (self.dir.join("etc-hosts"), "/etc/hosts".to_string(), false)),
            )
            .collect()
    }

    fn start(&mut self, idx: usize) {
        self.seq += 1;
        let seq = self.seq;
        let log_dir = self.dir.join("logs");
        let _ = std::fs::create_dir_all(&log_dir);
        let c = &self.ctrs[idx];
        let log_path = log_dir.join(format!("{}.log", c.status.name));
        let mounts = self.mounts(&c.spec);
        if self.sh.mount_ns {
            for (src, dst, _) in &mounts {
                let file = src.exists() && !src.is_dir();
                if let Err(e) = self.sh.created.ensure(Path::new(dst), file) {
                    warn!(pod = %self.key(), "creating mount point {dst}: {e}");
                }
            }
        }
        let workdir = c.spec.working_dir.clone().unwrap_or_else(|| "/".into());
        let hostname = pod_hostname(&self.pod);
        let result = spawn(
            &c.argv,
            &c.env,
            &mounts,
            &workdir,
            &hostname,
            &log_path,
            self.sh.mount_ns,
        );
        let now = Timestamp::now();
        let ip = self.ip_str();
        let c = &mut self.ctrs[idx];
        match result {
            Ok(mut child) => {
                let pid = child.id().unwrap_or(0) as i32;
                info!(pod = %format!("{}/{}", self.ns, self.name), container = %c.status.name, pid, argv = ?c.argv, ip = %ip, "started");
                self.sh.pgids.lock().unwrap().insert(pid);
                let mut probes = Vec::new();
                let pod_ip = self
                    .ip
                    .map(std::net::IpAddr::V4)
                    .unwrap_or([127, 0, 0, 1].into());
                for (kind, p) in [
                    (Kind::Readiness, &c.spec.readiness_probe),
                    (Kind::Liveness, &c.spec.liveness_probe),
                ] {
                    let Some(p) = p else { continue };
                    match probe::config(&c.spec, p, pod_ip) {
                        Ok(cfg) => probes.push(tokio::spawn(probe::run(
                            cfg,
                            kind,
                            idx,
                            seq,
                            pid,
                            c.env.clone(),
                            self.sh.mount_ns,
                            self.probe_tx.clone(),
                        ))),
                        Err(e) => warn!(container = %c.status.name, "{kind:?} probe ignored: {e}"),
                    }
                }
                c.status.ready = c.spec.readiness_probe.is_none();
                c.run = Some(Running {
                    seq,
                    pid,
                    started: now,
                    since: Instant::now(),
                    probes,
                });
                c.status.pid = Some(pid as u32);
                c.status.state = CState::Running { started: now };
                let tx = self.exit_tx.clone();
                tokio::spawn(async move {
                    let code = match child.wait().await {
                        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
                        Err(_) => 255,
                    };
                    let _ = tx.send(Exit { idx, seq, code });
                });
            }
            Err(e) => {
                warn!(container = %c.status.name, "start failed: {e}");
                // Like a container that exited at once with 128 (StartError).
                self.on_exit(idx, None, 128, Some("StartError"));
            }
        }
    }

    fn on_exit(&mut self, idx: usize, seq: Option<u64>, code: i32, reason: Option<&str>) {
        let deleting = is_deleting(&self.pod);
        let c = &mut self.ctrs[idx];
        let (started, ran) = match c.run.take() {
            Some(r) if seq.is_none_or(|s| s == r.seq) => {
                self.sh.pgids.lock().unwrap().remove(&r.pid);
                (r.started, r.since.elapsed())
            }
            Some(r) => {
                c.run = Some(r); // a stale exit
                return;
            }
            None if seq.is_some() => return,
            None => (Timestamp::now(), Duration::ZERO),
        };
        let term = CState::Terminated {
            exit_code: code,
            reason: reason.unwrap_or(exit_reason(code)).into(),
            started,
            finished: Timestamp::now(),
        };
        info!(pod = %format!("{}/{}", self.ns, self.name), container = %c.status.name, code, "exited");
        c.status.pid = None;
        c.status.ready = false;
        if !deleting && self.policy.restarts(code) {
            if ran >= Duration::from_secs(30) {
                c.failures = 0;
            }
            let wait = backoff(c.failures);
            c.failures += 1;
            c.next_start = Some(Instant::now() + wait);
            c.status.last = Some(term);
            c.status.state = CState::Waiting {
                reason: "CrashLoopBackOff".into(),
                message: Some(format!(
                    "back-off {}s restarting failed container",
                    wait.as_secs()
                )),
            };
        } else {
            c.status.state = term;
        }
    }

    async fn report(&mut self) {
        let prev = self
            .pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let ctrs: Vec<Ctr> = self.ctrs.iter().map(|c| c.status.clone()).collect();
        let ip = self.ip_str();
        let status = build_status(&StatusInput {
            policy: self.policy,
            ctrs: &ctrs,
            error: self.error.as_ref().map(|(r, m)| (r.as_str(), m.as_str())),
            deleting: is_deleting(&self.pod),
            pod_ip: &ip,
            host_ip: HOST_IP,
            start_time: self.start_time,
            prev_conditions: &prev,
            now: Timestamp::now(),
        });
        match self
            .api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await
        {
            Ok(p) => {
                // Keep our spec/metadata view (the watch delivers those) but
                // remember the conditions' transition times.
                self.pod.status = p.status;
            }
            Err(e) => warn!(pod = %self.key(), "patching pods/status failed: {e}"),
        }
    }

    async fn supervise(&mut self, rx: &mut watch::Receiver<Pod>) {
        loop {
            let next = self.ctrs.iter().filter_map(|c| c.next_start).min();
            let refresh = self.token_refresh;
            tokio::select! {
                Some(e) = self.exit_rx.recv() => {
                    self.on_exit(e.idx, Some(e.seq), e.code, None);
                    self.report().await;
                }
                Some(p) = self.probe_rx.recv() => {
                    let key = self.key();
                    let c = &mut self.ctrs[p.idx];
                    let Some(run) = c.run.as_ref().filter(|r| r.seq == p.seq) else { continue };
                    match p.kind {
                        Kind::Readiness => {
                            info!(pod = %key, container = %c.status.name, ready = p.ok, "readiness changed {}", p.message);
                            c.status.ready = p.ok;
                            self.report().await;
                        }
                        Kind::Liveness => {
                            warn!(pod = %key, container = %c.status.name, "liveness probe failed ({}): killing the container", p.message);
                            signal_group(run.pid, libc::SIGKILL);
                        }
                    }
                }
                _ = sleep_until(next) => {
                    let now = Instant::now();
                    for i in 0..self.ctrs.len() {
                        if self.ctrs[i].next_start.is_some_and(|t| t <= now) {
                            self.ctrs[i].next_start = None;
                            self.ctrs[i].status.restart_count += 1;
                            self.start(i);
                        }
                    }
                    self.report().await;
                }
                _ = sleep_until(refresh) => {
                    match self.fetch_refs().await {
                        Ok(refs) => if let Err(e) = self.write_volumes(&refs).await {
                            warn!(pod = %self.key(), "refreshing volumes: {e}");
                            self.token_refresh = Some(Instant::now() + Duration::from_secs(10));
                        },
                        Err(e) => {
                            warn!(pod = %self.key(), "refreshing volumes: {e}");
                            self.token_refresh = Some(Instant::now() + Duration::from_secs(10));
                        }
                    }
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        return; // the pod object is gone: cleanup kills what runs
                    }
                    let pod = rx.borrow_and_update().clone();
                    let status = self.pod.status.take();
                    self.pod = pod;
                    if self.pod.status.is_none() { self.pod.status = status; }
                    if is_deleting(&self.pod) {
                        self.terminate(rx).await;
                        self.finish_deletion().await;
                        return;
                    }
                }
            }
        }
    }

    /// SIGTERM every container's process group, wait up to the grace
    /// period, then SIGKILL.
    async fn terminate(&mut self, rx: &mut watch::Receiver<Pod>) {
        let grace = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30)
            .max(0) as u64;
        info!(pod = %self.key(), grace, "pod deleted: stopping its containers");
        for c in &mut self.ctrs {
            c.next_start = None;
            if let Some(r) = &c.run {
                signal_group(r.pid, libc::SIGTERM);
            }
            if matches!(c.status.state, CState::Waiting { .. }) {
                // Waiting to restart: it stays stopped; report its last exit.
                if let Some(last) = c.status.last.clone() {
                    c.status.state = last;
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(grace);
        let mut killed = false;
        while self.ctrs.iter().any(|c| c.run.is_some()) {
            tokio::select! {
                Some(e) = self.exit_rx.recv() => self.on_exit(e.idx, Some(e.seq), e.code, None),
                _ = tokio::time::sleep_until(deadline), if !killed => {
                    for c in &self.ctrs {
                        if let Some(r) = &c.run {
                            warn!(pod = %self.key(), container = %c.status.name, "still running after the grace period: SIGKILL");
                            signal_group(r.pid, libc::SIGKILL);
                        }
                    }
                    killed = true;
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // A shorter grace period (kubectl delete --force) wins.
                    let p = rx.borrow_and_update().clone();
                    if p.metadata.deletion_grace_period_seconds.is_some_and(|g| g == 0) && !killed {
                        for c in &self.ctrs {
                            if let Some(r) = &c.run { signal_group(r.pid, libc::SIGKILL); }
                        }
                        killed = true;
                    }
                }
            }
        }
        // Never-started containers count as terminated for the phase.
        for c in &mut self.ctrs {
            if let CState::Waiting { reason, .. } = &c.status.state {
                let now = Timestamp::now();
                let reason = if reason == "ContainerCreating" {
                    "ContainerCreating"
                } else {
                    "Error"
                };
                c.status.state = CState::Terminated {
                    exit_code: 137,
                    reason: reason.into(),
                    started: now,
                    finished: now,
                };
            }
        }
        self.report().await;
    }

    /// The last step of deletion: remove the pod object (grace period 0).
    async fn finish_deletion(&mut self) {
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.api.delete(&self.name, &dp).await {
            Ok(_) => info!(pod = %self.key(), "pod removed"),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => warn!(pod = %self.key(), "deleting the pod failed: {e}"),
        }
    }

    async fn wait_for_deletion(&mut self, rx: &mut watch::Receiver<Pod>) {
        loop {
            if is_deleting(&rx.borrow_and_update()) {
                self.finish_deletion().await;
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

fn keyed_files(
    data: Option<&BTreeMap<String, String>>,
    items: Option<&[KeyToPath]>,
    optional: Option<bool>,
    what: &str,
    name: &str,
) -> Result<Vec<(String, Vec<u8>)>, String> {
    let Some(data) = data else {
        return if optional.unwrap_or(false) {
            Ok(Vec::new())
        } else {
            Err(format!("{what} {name:?} not found"))
        };
    };
    match items {
        Some(items) if !items.is_empty() => items
            .iter()
            .map(|i| {
                data.get(&i.key)
                    .map(|v| (i.path.clone(), v.clone().into_bytes()))
                    .ok_or_else(|| format!("key {:?} not found in {what} {name:?}", i.key))
            })
            .collect(),
        _ => Ok(data
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect()),
    }
}

fn write_atomic(dir: &Path, rel: &str, data: &[u8]) -> Result<(), String> {
    if rel.split('/').any(|p| p == "..") || rel.starts_with('/') {
        return Err(format!("volume file path {rel:?} is not allowed"));
    }
    let path = dir.join(rel);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let tmp = path.with_extension("weir-tmp");
    std::fs::write(&tmp, data)
        .and_then(|_| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The pod's hostname: spec.hostname, else its name (at most 63 bytes).
pub fn pod_hostname(pod: &Pod) -> String {
    let h = pod
        .spec
        .as_ref()
        .and_then(|s| s.hostname.clone())
        .or_else(|| pod.metadata.name.clone())
        .unwrap_or_default();
    h.chars().take(63).collect()
}

/// The pod's /etc/hosts: localhost, its own name at its IP, hostAliases.
pub fn hosts_file(pod: &Pod, ip: &str) -> String {
    let mut s = String::from(
        "# Kubernetes-managed hosts file (weir node agent).\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    );
    let host = pod_hostname(pod);
    let spec = pod.spec.as_ref();
    match (
        spec.and_then(|s| s.subdomain.as_deref()),
        pod.metadata.namespace.as_deref(),
    ) {
        (Some(sub), Some(ns)) => {
            s += &format!("{ip}\t{host}.{sub}.{ns}.svc.cluster.local\t{host}\n")
        }
        _ => s += &format!("{ip}\t{host}\n"),
    }
    for a in spec
        .and_then(|s| s.host_aliases.as_ref())
        .into_iter()
        .flatten()
    {
        if let Some(names) = &a.hostnames {
            s += &format!(
                "\n# Entries added by HostAliases.\n{}\t{}\n",
                a.ip,
                names.join("\t")
            );
        }
    }
    s
}

/// Single-quote for /bin/sh.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The shell script run inside the container's private mount namespace:
/// bind each volume at its mount path, then exec the container's argv
/// (`"$@"`).
pub fn mount_script(mounts: &[(PathBuf, String, bool)], workdir: &str, hostname: &str) -> String {
    let mut s = String::from("set -e\n");
    if !hostname.is_empty() {
        s += &format!("hostname {} 2>/dev/null || true\n", sh_quote(hostname));
    }
    for (src, dst, ro) in mounts {
        let (src_q, dst_q) = (sh_quote(&src.display().to_string()), sh_quote(dst));
        if src.is_dir() || !src.exists() {
            s += &format!("mkdir -p {src_q} {dst_q}\n");
        } else {
            s += &format!("mkdir -p \"$(dirname {dst_q})\"; [ -e {dst_q} ] || : > {dst_q}\n");
        }
        s += &format!("mount --bind {src_q} {dst_q}\n");
        if *ro {
            s += &format!("mount -o remount,bind,ro {dst_q}\n");
        }
    }
    s += &format!("cd {}\nexec \"$@\"\n", sh_quote(workdir));
    s
}

fn spawn(
    argv: &[String],
    env: &[(String, String)],
    mounts: &[(PathBuf, String, bool)],
    workdir: &str,
    hostname: &str,
    log: &Path,
    mount_ns: bool,
) -> std::io::Result<tokio::process::Child> {
    let Some((prog, args)) = argv.split_first() else {
        return Err(std::io::Error::other("empty command"));
    };
    let mut cmd = if mount_ns {
        let mut c = tokio::process::Command::new("unshare");
        c.args([
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
        ])
        .arg(mount_script(mounts, workdir, hostname))
        .arg("weir-pod")
        .arg(prog)
        .args(args);
        c
    } else {
        let mut c = tokio::process::Command::new(prog);
        c.args(args).current_dir(workdir);
        c
    };
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    cmd.env_clear()
        .env(
            "PATH",
            std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .env("HOME", "/root")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(false)
        .process_group(0);
    // SAFETY: prctl is async-signal-safe. The container dies with the agent
    // (the agent runs on one thread, so "parent thread exits" = agent exits).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_created_and_removed_when_empty() {
        let base = std::env::temp_dir().join(format!("weir-mp-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let mp = MountPoints::default();
        mp.ensure(&base.join("a/b/c"), false).unwrap();
        mp.ensure(&base.join("f/file"), true).unwrap();
        mp.ensure(&base.join("keep/x"), false).unwrap();
        std::fs::write(base.join("keep/data"), b"user data").unwrap();
        assert!(base.join("a/b/c").is_dir() && base.join("f/file").is_file());
        mp.remove_all();
        assert!(!base.join("a").exists() && !base.join("f").exists());
        assert!(base.join("keep/data").exists() && !base.join("keep/x").exists());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn hosts() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "w-0", "namespace": "jobs"},
            "spec": {"containers": [], "subdomain": "w", "hostAliases": [{"ip": "127.0.1.9", "hostnames": ["kafka"]}]}
        }))
        .unwrap();
        let h = hosts_file(&pod, "127.0.1.3");
        assert!(
            h.contains("127.0.1.3\tw-0.w.jobs.svc.cluster.local\tw-0\n"),
            "{h}"
        );
        assert!(h.contains("127.0.1.9\tkafka\n"));
        assert!(h.contains("127.0.0.1\tlocalhost\n"));
    }

    #[test]
    fn quoting() {
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), "'it'\\''s'");
    }

    #[test]
    fn script_binds_and_execs() {
        let s = mount_script(
            &[(
                PathBuf::from("/nonexistent/v/tok"),
                "/var/run/secrets/x".into(),
                true,
            )],
            "/",
            "p-1",
        );
        assert!(s.contains("hostname 'p-1'"));
        assert!(
            s.contains("mount --bind '/nonexistent/v/tok' '/var/run/secrets/x'"),
            "{s}"
        );
        assert!(s.contains("remount,bind,ro"));
        assert!(s.ends_with("cd '/'\nexec \"$@\"\n"));
    }

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff(0), Duration::from_secs(1));
        assert_eq!(backoff(1), Duration::from_secs(2));
        assert_eq!(backoff(10), Duration::from_secs(20));
    }

    #[test]
    fn keyed_volume_files() {
        let d: BTreeMap<String, String> = [("a".to_string(), "1".to_string())].into();
        assert_eq!(
            keyed_files(Some(&d), None, None, "configmap", "c").unwrap(),
            vec![("a".to_string(), b"1".to_vec())]
        );
        let items = [KeyToPath {
            key: "a".into(),
            path: "sub/x".into(),
            mode: None,
        }];
        assert_eq!(
            keyed_files(Some(&d), Some(&items), None, "configmap", "c").unwrap()[0].0,
            "sub/x"
        );
        assert!(keyed_files(None, None, None, "secret", "s").is_err());
        assert!(keyed_files(None, None, Some(true), "secret", "s")
            .unwrap()
            .is_empty());
        assert!(write_atomic(Path::new("/tmp"), "../etc/x", b"").is_err());
    }
}
