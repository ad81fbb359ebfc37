//! One reconcile of one StreamJob: observe, decide, write status, act.
//! The deciding is in [`crate::lifecycle`]; this module only talks to the
//! API server and the workers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use tracing::{debug, info, instrument, warn};
use weir_api::control::{SavepointRequest, CONTROL_PORT};
use weir_api::streamjob::{StreamJob, StreamJobStatus};

use crate::context::{Context, Superseded};
use crate::desired;
use crate::error::{Error, Result};
use crate::lifecycle::{Decision, Effect};
use crate::names;
use crate::lifecycle::REFUSED_POD;
use crate::observe::{DisposalOutcome, Observed, PodState, PodView, Rejection, RunHealth};
use crate::worker_api::Access;
use crate::FIELD_MANAGER;

/// How soon a reconcile skipped for a stale object looks again, should the
/// watch event of the operator's own write be slower than that (it normally
/// triggers the next reconcile itself).
const STALE_RETRY: Duration = Duration::from_secs(1);

#[instrument(skip_all, fields(job = %job.name_any(), namespace = job.namespace().unwrap_or_default()))]
pub async fn reconcile(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Action> {
    if is_superseded(&job, &ctx) {
        // The watch has not delivered this operator's own last write yet.
        // Deciding on the older object would decide again what was already
        // decided and written (a second status write, event and set of
        // applies); the watch event of the write triggers the next reconcile.
        debug!("the cached StreamJob predates this operator's last write; waiting for the watch");
        ctx.metrics.skipped_stale();
        return Ok(Action::requeue(STALE_RETRY));
    }
    let started = Instant::now();
    let result = reconcile_inner(&job, &ctx).await;
    ctx.metrics.reconciled(started.elapsed(), result.as_ref().err());
    result
}

/// The JSON patch that adds the operator's finalizer to `job`: a merge
/// patch would replace the whole list, dropping other controllers'
/// finalizers. The `test` makes the patch fail (and the reconcile retry)
/// if the list changed since it was read, since the API server does not
/// remove duplicates; a job without the list is tested by its version,
/// as a missing member cannot be tested.
fn adding_the_finalizer(job: &StreamJob) -> serde_json::Result<json_patch::Patch> {
    let existing = job.finalizers();
    let ops = if existing.is_empty() {
        let mut ops = vec![serde_json::json!({"op": "add", "path": "/metadata/finalizers", "value": [names::FINALIZER]})];
        if let Some(version) = &job.metadata.resource_version {
            ops.insert(0, serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}));
        }
        serde_json::Value::Array(ops)
    } else {
        serde_json::json!([
            {"op": "test", "path": "/metadata/finalizers", "value": existing},
            {"op": "add", "path": "/metadata/finalizers/-", "value": names::FINALIZER},
        ])
    };
    serde_json::from_value(ops)
}

async fn reconcile_inner(job: &StreamJob, ctx: &Context) -> Result<Action> {
    let ns = job.namespace().ok_or(Error::NoNamespace)?;
    let name = job.name_any();
    let jobs: Api<StreamJob> = Api::namespaced(ctx.client.clone(), &ns);
    let deleting = job.meta().deletion_timestamp.is_some();
    let has_finalizer = job.finalizers().iter().any(|f| f == names::FINALIZER);
    if deleting && !has_finalizer {
        return Ok(Action::await_change());
    }
    if !deleting && !has_finalizer {
        // The finalizer first: a job must never have pods the operator could not
        // take a final savepoint of.
        let patch = adding_the_finalizer(job).map_err(|e| Error::Build { object: name.clone(), message: e.to_string() })?;
        let patched = jobs.patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch)).await.map_err(Error::kube("adding the finalizer"))?;
        wrote(job, &patched, ctx);
        return Ok(Action::requeue(Duration::ZERO));
    }

    // The pods from the operator's pod watch when it has them; a decision
    // that would write or act is made on a consistent list, as without it.
    let cached = cached_pods(ctx, &ns, &name);
    let from_cache = cached.is_some();
    let pods = match cached {
        Some(pods) => pods,
        None => list_pods(ctx, &ns, &name).await?,
    };
    let mut observed = observe(job, ctx, pods).await?;
    let mut decision = ctx.decide(job, &mut observed);
    let old = job.status.clone().unwrap_or_default();
    if from_cache && !quiet(&decision, &old) {
        let listed = list_pods(ctx, &ns, &name).await?;
        if listed != observed.pods {
            debug!("the pod watch was behind the API server; deciding on the listed pods");
            observed = observe(job, ctx, listed).await?;
            decision = ctx.decide(job, &mut observed);
        }
    }
    if decision.status == old {
        ctx.status_written(job, &decision.status);
    } else {
        match write_status(&jobs, &name, job.resource_version(), &decision.status).await {
            Ok(written) => {
                wrote(job, &written, ctx);
                ctx.status_written(job, &decision.status);
            }
            Err(Error::Kube { source: kube::Error::Api(e), .. }) if e.code == 409 => {
                // Decided on an object that has changed since: nothing is
                // carried out; the newer version (its watch event triggers a
                // reconcile) is decided on instead.
                debug!("the StreamJob changed since it was read; deciding again on the newer version");
                ctx.metrics.status_conflict();
                return Ok(Action::requeue(STALE_RETRY));
            }
            Err(e) => return Err(e),
        }
    }
    if let Some((from, to, spent)) = &decision.transition {
        info!(from = ?from, to = ?to, spent_ms = spent.as_millis() as u64, message = decision.status.message.as_deref().unwrap_or(""), "phase changed");
        ctx.metrics.transition(*from, *to, *spent);
    }
    ctx.metrics.set_phase(job, decision.status.phase);
    publish(ctx, job, &decision).await;
    act(job, ctx, &ns, &decision, &observed.pods).await?;
    Ok(Action::requeue(decision.requeue))
}

/// A decision that neither writes, acts, publishes nor changes the phase.
fn quiet(decision: &Decision, old: &StreamJobStatus) -> bool {
    decision.status == *old && decision.effects.is_empty() && decision.notes.is_empty() && decision.transition.is_none()
}

/// The job's pods as the API server lists them (a consistent read), by name.
async fn list_pods(ctx: &Context, ns: &str, job: &str) -> Result<Vec<PodView>> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let list = pods.list(&ListParams::default().labels(&names::job_selector(job))).await.map_err(Error::kube("listing the job's pods"))?;
    let mut views: Vec<PodView> = list.items.iter().map(PodView::of).collect();
    views.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(views)
}

/// The job's pods from the operator's pod watch, by name; `None` without a
/// pod cache or before its first list. At least as new as the pod event that
/// triggered this reconcile (the same watch feeds both), but it may lag
/// behind the pods this operator has just applied or deleted itself.
fn cached_pods(ctx: &Context, ns: &str, job: &str) -> Option<Vec<PodView>> {
    let pods = ctx.pods.as_ref()?.pods(ns, job)?;
    Some(pods.iter().map(|p| PodView::of(p)).collect())
}

async fn observe(job: &StreamJob, ctx: &Context, pods: Vec<PodView>) -> Result<Observed> {
    let mut observed = Observed::at(jiff::Timestamp::now());
    observed.pods = pods;
    observed.disposals = ctx.disposals_of(job);
    let status = job.status.clone().unwrap_or_default();
    let Some(run) = &status.run else { return Ok(observed) };
    observed.silent = run.silent_pods.clone();
    observed.kubelets_gone = kubelets_gone(&observed.pods, &run.id).await;
    observed.rejected = job
        .uid()
        .and_then(|uid| ctx.rejections.lock().ok().and_then(|m| m.get(&uid).cloned()))
        .filter(|r| r.run_id == run.id);
    let RunHealth::Running { ips } = observed.health(run) else { return Ok(observed) };
    let Some(ip) = ips.first() else { return Ok(observed) };
    let api = SocketAddr::new(*ip, CONTROL_PORT);
    let to = access(job, ctx, &observed.pods, api);
    match ctx.workers.status(api, &to).await {
        Ok(s) => observed.coordinator = Some(s),
        Err(e) => {
            debug!(error = %e, "coordinator did not answer");
            observed.coordinator_error = Some(e.to_string());
        }
    }
    if let Some(id) = status.pending_savepoint.as_ref().and_then(|p| p.request_id.as_deref()) {
        if observed.coordinator.is_some() {
            match ctx.workers.savepoint_outcome(api, &to, id).await {
                Ok(o) => observed.savepoint = Some(o),
                Err(e) => debug!(error = %e, "savepoint outcome not available"),
            }
        }
    }
    Ok(observed)
}

/// Whether some kubelet ever answered this operator's probe: until one
/// did, a refusal may be a firewall between the operator and every kubelet.
static A_KUBELET_ANSWERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The nodes of pods of other runs being deleted whose kubelet does not
/// take a TCP connection within a second: a killed node refuses at once, a
/// cut-off one does not answer. Probed while pods are being deleted, and
/// once when a pod of the job failed (the failure's reconcile still sees
/// pods on live nodes), to learn that kubelets answer at all: a refusal is
/// trusted only once some kubelet has answered. A frozen
/// kubelet's kernel still accepts, so that case is left to the workers'
/// heartbeats (`status.run.silentPods`).
async fn kubelets_gone(pods: &[PodView], run: &str) -> Vec<std::net::IpAddr> {
    use crate::observe::PodState;
    use std::sync::atomic::Ordering;
    let deleted: Vec<&PodView> = pods.iter().filter(|p| p.state == PodState::Terminating && p.run.as_deref() != Some(run)).collect();
    // With nothing to judge, probe only to learn that kubelets answer (once).
    let calibrating = !A_KUBELET_ANSWERED.load(Ordering::Relaxed) && pods.iter().any(|p| matches!(p.state, PodState::Failed { .. }));
    if deleted.is_empty() && !calibrating {
        return Vec::new();
    }
    let mut hosts: Vec<std::net::IpAddr> = pods.iter().filter_map(|p| p.host_ip).collect();
    hosts.sort();
    hosts.dedup();
    // At once, not one after another: a reconcile waits a second at most.
    let probes = futures::future::join_all(hosts.iter().map(|&ip| async move {
        let probe = tokio::time::timeout(std::time::Duration::from_secs(1), tokio::net::TcpStream::connect((ip, crate::observe::KUBELET_PORT))).await;
        (ip, matches!(probe, Ok(Ok(_))))
    }))
    .await;
    let mut gone = Vec::new();
    for (ip, answered) in probes {
        if answered {
            A_KUBELET_ANSWERED.store(true, Ordering::Relaxed);
        } else if deleted.iter().any(|p| p.host_ip == Some(ip)) {
            debug!(%ip, "the kubelet of a node with pods being deleted does not answer");
            gone.push(ip);
        }
    }
    if A_KUBELET_ANSWERED.load(Ordering::Relaxed) {
        gone
    } else {
        Vec::new()
    }
}

async fn write_status(jobs: &Api<StreamJob>, name: &str, read_version: Option<String>, status: &StreamJobStatus) -> Result<StreamJob> {
    // The version the decision was made on is a precondition: if anything
    // changed the StreamJob since (a user's edit, or this operator's own
    // earlier write that the watch had not shown yet), the API server refuses
    // the write with 409 and nothing of the decision is carried out. Without
    // it, a decision made twice (once on the newer, once on the older object)
    // could take two savepoints or count one failure twice.
    let mut patch = serde_json::json!({
        "apiVersion": "weir.dev/v1alpha1",
        "kind": "StreamJob",
        "status": status,
    });
    if let Some(rv) = read_version {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    jobs.patch_status(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .map_err(Error::kube("writing the status"))
}

/// Records that `read` was changed into `written` by this operator, unless the
/// write changed nothing (same resourceVersion).
fn wrote(read: &StreamJob, written: &StreamJob, ctx: &Context) {
    let (Some(uid), Some(before), Some(after)) = (read.uid(), read.resource_version(), written.resource_version()) else { return };
    if before != after {
        if let Ok(mut m) = ctx.superseded.lock() {
            m.insert(uid, Superseded { read: before, written: after });
        }
    }
}

/// Whether `job` is older than this operator's last write to it, i.e. the
/// watch has not shown that write yet. resourceVersions are compared as the
/// numbers the API server gives out (etcd revisions); should one not be a
/// number, only the very version the operator read counts as older. The
/// written version or anything newer ends the wait. (The status write's
/// precondition keeps a decision on an older object from being carried out
/// even when this check lets it through.)
fn is_superseded(job: &StreamJob, ctx: &Context) -> bool {
    let (Some(uid), Some(rv)) = (job.uid(), job.resource_version()) else { return false };
    let Ok(mut m) = ctx.superseded.lock() else { return false };
    let Some(last) = m.get(&uid) else { return false };
    let older = match (rv.parse::<u64>(), last.written.parse::<u64>()) {
        (Ok(seen), Ok(written)) => seen < written,
        _ => rv == last.read,
    };
    if !older {
        m.remove(&uid);
    }
    older
}

async fn publish(ctx: &Context, job: &StreamJob, decision: &Decision) {
    let reference = job.object_ref(&());
    for note in &decision.notes {
        let event = KubeEvent {
            type_: if note.warning { EventType::Warning } else { EventType::Normal },
            reason: note.reason.clone(),
            note: Some(note.message.chars().take(1000).collect()),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            // An event that cannot be written must not stop the lifecycle.
            warn!(error = %e, reason = %note.reason, "could not publish an event");
        }
    }
}

/// Carries out the decision's effects. `pods` is what the decision was made
/// on: a decision with effects is never quiet, so they come from the API
/// server's list, not from the pod cache.
async fn act(job: &StreamJob, ctx: &Context, ns: &str, decision: &Decision, pods: &[PodView]) -> Result<()> {
    for effect in &decision.effects {
        match effect {
            Effect::CreateRun => {
                if let Err(e) = create_run(job, ctx, ns, &decision.status).await {
                    // The status already says the pods were created; the next
                    // reconcile must not take their absence for pods that went
                    // missing (a restart): it reports what the API server said.
                    if let (Some(uid), Some(run)) = (job.uid(), &decision.status.run) {
                        if let Ok(mut m) = ctx.rejections.lock() {
                            m.insert(uid, rejection(&run.id, &e));
                        }
                    }
                    return Err(e);
                }
            }
            Effect::DeleteOtherPods => delete_pods(ctx, ns, pods, decision.status.run.as_ref().map(|r| r.id.as_str())).await?,
            Effect::DeleteAllPods => delete_pods(ctx, ns, pods, None).await?,
            Effect::SendMembership { membership, workers } => {
                let sent = workers.iter().map(|w| {
                    let to = access(job, ctx, pods, *w);
                    async move {
                        match ctx.workers.put_membership(*w, &to, membership).await {
                            Ok(_) => {}
                            // The worker answered and said no (another run's
                            // membership, a worker count its pipeline does not
                            // have): it will never join, so it is no debug detail.
                            Err(e) if matches!(&e, Error::Worker { message, .. } if message.starts_with("HTTP ")) => {
                                warn!(worker = %w, error = %e, "the worker refused its membership")
                            }
                            // Not started listening yet: the next reconcile sends again.
                            Err(e) => debug!(worker = %w, error = %e, "membership not delivered yet"),
                        }
                    }
                });
                futures::future::join_all(sent).await;
            }
            Effect::RequestSavepoint { api, request_id, stop } => {
                let request = SavepointRequest { request_id: Some(request_id.clone()), stop: *stop };
                match ctx.workers.request_savepoint(*api, &access(job, ctx, pods, *api), &request).await {
                    Ok(o) => debug!(request = %request_id, state = ?o.state, "savepoint requested"),
                    // Retried by the waiting state until spec.savepointTimeout.
                    Err(e) => warn!(request = %request_id, error = %e, "savepoint request not accepted yet"),
                }
            }
            Effect::CancelSavepoint { api, request_id } => {
                match ctx.workers.cancel_savepoint(*api, &access(job, ctx, pods, *api), request_id).await {
                    Ok(o) => info!(request = %request_id, state = ?o.map(|o| o.state), "savepoint request cancelled"),
                    // Not fatal: a job left stopped is restarted once its
                    // checkpoints stall (CheckpointsStalled).
                    Err(e) => warn!(request = %request_id, error = %e, "savepoint request not cancelled"),
                }
            }
            Effect::DisposeSavepoint { api, location } => {
                match ctx.workers.dispose_savepoint(*api, &access(job, ctx, pods, *api), location).await {
                    Ok(d) => {
                        info!(savepoint = %location, existed = d.existed, "savepoint disposed of");
                        ctx.disposal_done(job, location, DisposalOutcome::Disposed);
                    }
                    // Not this job's savepoint (its storage changed): it can never be.
                    Err(Error::Worker { message, .. }) if message.starts_with("HTTP 400") => {
                        warn!(savepoint = %location, error = %message, "savepoint not disposed of");
                        ctx.disposal_done(job, location, DisposalOutcome::Refused(message));
                    }
                    // The latest snapshot or a run without a checkpoint yet: asked again later.
                    Err(Error::Worker { message, .. }) if message.starts_with("HTTP 409") || message.starts_with("HTTP 503") => {
                        debug!(savepoint = %location, error = %message, "savepoint not disposed of yet")
                    }
                    // Storage trouble, a worker that does not answer: asked again later.
                    Err(e) => warn!(savepoint = %location, error = %e, "savepoint not disposed of yet"),
                }
            }
            Effect::RemoveFinalizer => {
                let jobs: Api<StreamJob> = Api::namespaced(ctx.client.clone(), ns);
                // JSON patch with a test of the exact entry: other controllers'
                // finalizers stay, and no resourceVersion precondition fails just
                // because this reconcile wrote the status a moment ago.
                if let Some(i) = job.finalizers().iter().position(|f| f == names::FINALIZER) {
                    let path = format!("/metadata/finalizers/{i}");
                    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
                        {"op": "test", "path": path, "value": names::FINALIZER},
                        {"op": "remove", "path": path},
                    ]))
                    .map_err(|e| Error::Build { object: job.name_any(), message: e.to_string() })?;
                    match jobs.patch(&job.name_any(), &PatchParams::default(), &Patch::<()>::Json(patch)).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(e) => return Err(Error::kube("removing the finalizer")(e)),
                    }
                }
                ctx.metrics.forget(job);
                if let Some(uid) = job.uid() {
                    if let Ok(mut m) = ctx.superseded.lock() {
                        m.remove(&uid);
                    }
                    if let Ok(mut m) = ctx.rejections.lock() {
                        m.remove(&uid);
                    }
                    if let Ok(mut m) = ctx.disposals.lock() {
                        m.remove(&uid);
                    }
                }
            }
        }
    }
    Ok(())
}

/// What to report when creating a run's objects failed: a worker pod the API
/// server refused (4xx: Pod Security admission, a quota, a webhook, an
/// invalid pod) is `PodRejected` with the API server's message; anything
/// else (another object, the API server not answering) `RunNotCreated`.
fn rejection(run_id: &str, error: &Error) -> Rejection {
    let (reason, message) = match error {
        Error::Kube { action, source: kube::Error::Api(e) } if action.starts_with(APPLYING_POD) && matches!(e.code, 400 | 403 | 404 | 422) => {
            let pod = action.trim_start_matches(APPLYING_POD);
            ("PodRejected", format!("{REFUSED_POD} {pod} ({} {}): {}", e.code, e.reason, e.message))
        }
        other => ("RunNotCreated", format!("the run's objects were not created: {other}")),
    };
    Rejection { run_id: run_id.to_string(), reason: reason.into(), message }
}

/// The action of an error applying a pod: "applying pod <name>".
const APPLYING_POD: &str = "applying pod ";

async fn create_run(job: &StreamJob, ctx: &Context, ns: &str, status: &StreamJobStatus) -> Result<()> {
    let Some(run) = &status.run else { return Ok(()) };
    if let (Some(uid), Ok(mut m)) = (job.uid(), ctx.rejections.lock()) {
        // A new attempt: an earlier refusal no longer speaks for this one.
        m.remove(&uid);
    }
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let config_maps = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(ctx.client.clone(), ns);
    // The run's pods are built from the spec the run was decided on, which
    // is the current one unless that is refused: then it is the deployed
    // spec the pipeline ConfigMap keeps.
    let stored = if desired::job_for_run(job, run, None, &ctx.settings).1 {
        None
    } else if let Some(spec) = desired::stable_spec_of(status, run) {
        // A rollback's run: the failed upgrade overwrote the ConfigMap.
        Some(spec)
    } else {
        let cm = config_maps.get_opt(&names::pipeline_config_map(&job.name_any())).await.map_err(Error::kube("reading the pipeline ConfigMap"))?;
        cm.as_ref().and_then(desired::spec_of_config_map)
    };
    let (run_job, same) = desired::job_for_run(job, run, stored, &ctx.settings);
    if !same {
        warn!(run = %run.id, spec = %run.spec_hash, "the spec the run was decided on is not available; building its pods from the spec at hand");
    }
    let job = &run_job;
    // Every object is built before any is sent: a spec that cannot be built
    // creates nothing.
    let cm = desired::pipeline_config_map(job)?;
    let svc = desired::workers_service(job)?;
    let policy = ctx.settings.network_policy.as_ref().map(|s| desired::network_policy(job, s)).transpose()?;
    let wanted: Vec<Pod> = (0..run.workers.max(0) as u32).map(|index| desired::worker_pod(job, run, index, &ctx.settings)).collect::<Result<_>>()?;
    // A worker needs its token (env from the Secret) and its pipeline (the
    // ConfigMap volume) to start, so those exist before any pod; apart from
    // that nothing depends on anything, and each round trip to the API server
    // is what a new run waits on (recovery, upgrade), so the requests of a
    // round go out together.
    let services = Api::<k8s_openapi::api::core::v1::Service>::namespaced(ctx.client.clone(), ns);
    let policies = Api::<NetworkPolicy>::namespaced(ctx.client.clone(), ns);
    futures::try_join!(
        token_secret(job, ctx, ns),
        async { config_maps.patch(&cm.name_any(), &apply, &Patch::Apply(&cm)).await.map_err(Error::kube("applying the pipeline ConfigMap")) },
        async { services.patch(&svc.name_any(), &apply, &Patch::Apply(&svc)).await.map_err(Error::kube("applying the workers Service")) },
        async {
            let Some(p) = &policy else { return Ok(()) };
            policies.patch(&p.name_any(), &apply, &Patch::Apply(p)).await.map(|_| ()).map_err(Error::kube("applying the workers NetworkPolicy"))
        },
    )?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    futures::future::try_join_all(wanted.iter().map(|pod| {
        let pods = &pods;
        let apply = &apply;
        async move { pods.patch(&pod.name_any(), apply, &Patch::Apply(pod)).await.map_err(Error::kube(format!("{APPLYING_POD}{}", pod.name_any()))) }
    }))
    .await?;
    info!(run = %run.id, workers = run.workers, restore = run.restore_from.as_deref().unwrap_or("none"), "created the run's pods");
    Ok(())
}

/// Deletes `listed` (the job's pods), except those of `keep_run` and those
/// already being deleted.
async fn delete_pods(ctx: &Context, ns: &str, listed: &[PodView], keep_run: Option<&str>) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let doomed = listed.iter().filter(|pod| !(keep_run.is_some() && pod.run.as_deref() == keep_run || pod.state == PodState::Terminating));
    // All at once: the next run waits until every one of them is gone.
    futures::future::try_join_all(doomed.map(|pod| {
        let api = &api;
        async move {
            match api.delete(&pod.name, &DeleteParams::default()).await {
                Ok(_) => {
                    info!(pod = %pod.name, "deleted a pod");
                    Ok(())
                }
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(Error::kube(format!("deleting pod {}", pod.name))(e)),
            }
        }
    }))
    .await?;
    Ok(())
}

/// The job's control token, derived from the operator's control key (see
/// [`crate::control_key`]): nothing to read from the API server.
fn token(job: &StreamJob, ctx: &Context) -> String {
    ctx.control_key.token(&job.uid().unwrap_or_default())
}

/// How the operator calls the worker at `addr`: the job's token and, when
/// its pod was built with `spec.tls`, the name its certificate carries. The
/// pod says, not the current spec: an upgrade that adds or removes
/// `spec.tls` takes its savepoint from pods built without (or with) it.
fn access(job: &StreamJob, ctx: &Context, pods: &[PodView], addr: SocketAddr) -> Access {
    let tls_name = match pods.iter().find(|p| p.ip == Some(addr.ip())) {
        Some(pod) => pod.tls_name.clone(),
        None => job.spec.tls.as_ref().map(|_| crate::desired::tls_server_name(job)),
    };
    Access { token: token(job, ctx), tls_name }
}

/// Makes sure the job's token Secret exists before a run's pods need it
/// (someone may have deleted it; the workers would never start without
/// it). Created, never read or changed: the operator may create Secrets
/// but not read them, and an existing one holds the same derived token.
async fn token_secret(job: &StreamJob, ctx: &Context, ns: &str) -> Result<()> {
    let secret = desired::token_secret(job, &token(job, ctx), &ctx.settings)?;
    match Api::<Secret>::namespaced(ctx.client.clone(), ns).create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(Error::kube("creating the control token Secret")(e)),
    }
}

/// Failed reconciles are retried soon; the error is in the log and metrics.
pub fn error_policy(job: Arc<StreamJob>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(job = %job.name_any(), error = %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use http::{Request, Response};
    use kube::client::Body;
    use kube::Client;
    use kube::runtime::watcher;

    use super::*;
    use crate::desired::WorkerSettings;
    use crate::metrics::Metrics;
    use crate::pod_cache::PodCache;
    use crate::testing::{self, JobBuilder};
    use crate::worker_api::HttpWorkerApi;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    /// A context on a mocked API server; with `pods`, a pod cache holding them.
    fn context_on(pods: Option<&[Pod]>) -> (Arc<Context>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "jobs");
        let mut ctx = Context::new(client, Arc::new(HttpWorkerApi::new().unwrap()), Arc::new(Metrics::new()), WorkerSettings::default(), None);
        if let Some(pods) = pods {
            ctx = ctx.with_pod_cache(pod_cache(pods));
        }
        (Arc::new(ctx), handle)
    }

    fn context() -> (Arc<Context>, Handle) {
        context_on(None)
    }

    fn job(resource_version: &str, finalizer: bool) -> StreamJob {
        let mut j = JobBuilder::new("j").build();
        j.metadata.resource_version = Some(resource_version.into());
        if !finalizer {
            j.metadata.finalizers = None;
        }
        j
    }

    async fn answer(handle: &mut Handle, method: &str, path: &str, body: &StreamJob) {
        let (req, send) = handle.next_request().await.expect("a request");
        assert_eq!((req.method().as_str(), req.uri().path()), (method, path));
        send.send_response(Response::builder().status(200).body(Body::from(serde_json::to_vec(body).unwrap())).unwrap());
    }

    #[test]
    fn adding_the_finalizer_keeps_other_controllers_finalizers() {
        let mut read = job("1", false);
        read.metadata.finalizers = Some(vec!["example.com/backup".into()]);
        let mut server = serde_json::to_value(&read).unwrap();
        json_patch::patch(&mut server, &adding_the_finalizer(&read).unwrap()).unwrap();
        assert_eq!(server["metadata"]["finalizers"], serde_json::json!(["example.com/backup", names::FINALIZER]));

        // Another controller's finalizer added after the read: the patch
        // fails rather than add a duplicate or drop one.
        let mut raced = serde_json::to_value(&read).unwrap();
        raced["metadata"]["finalizers"] = serde_json::json!(["example.com/backup", "example.com/audit"]);
        assert!(json_patch::patch(&mut raced, &adding_the_finalizer(&read).unwrap()).is_err());
        assert_eq!(raced["metadata"]["finalizers"], serde_json::json!(["example.com/backup", "example.com/audit"]));
    }

    #[test]
    fn adding_the_first_finalizer_makes_the_list_unless_the_job_changed_since_it_was_read() {
        let read = job("1", false);
        let mut server = serde_json::to_value(&read).unwrap();
        json_patch::patch(&mut server, &adding_the_finalizer(&read).unwrap()).unwrap();
        assert_eq!(server["metadata"]["finalizers"], serde_json::json!([names::FINALIZER]));

        let mut changed = serde_json::to_value(&read).unwrap();
        changed["metadata"]["resourceVersion"] = serde_json::json!("2");
        changed["metadata"]["finalizers"] = serde_json::json!(["example.com/backup"]);
        assert!(json_patch::patch(&mut changed, &adding_the_finalizer(&read).unwrap()).is_err(), "a list made since the read is not replaced");
        assert_eq!(changed["metadata"]["finalizers"], serde_json::json!(["example.com/backup"]));
    }

    #[tokio::test]
    async fn the_version_the_operator_just_changed_is_not_reconciled_again_until_the_watch_shows_the_change() {
        let (ctx, mut handle) = context();
        // Version 7 has no finalizer: the reconcile adds it, making version 8.
        let server = tokio::spawn(async move {
            answer(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j", &job("8", true)).await;
            handle
        });
        reconcile(Arc::new(job("7", false)), ctx.clone()).await.unwrap();
        let mut handle = server.await.unwrap();

        // The watch still shows version 7: no request, a look again soon.
        let action = reconcile(Arc::new(job("7", false)), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(STALE_RETRY));
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "nothing decided on the stale version");
        assert!(ctx.metrics.encode().contains("weir_operator_reconciles_skipped_stale_total 1"));

        // Version 8 arrives: reconciled as usual (it lists the job's pods first).
        let server = tokio::spawn(async move {
            let (req, _send) = handle.next_request().await.expect("a request");
            assert_eq!((req.method().as_str(), req.uri().path()), ("GET", "/api/v1/namespaces/jobs/pods"));
        });
        let _ = tokio::time::timeout(Duration::from_millis(200), reconcile(Arc::new(job("8", true)), ctx.clone())).await;
        server.await.unwrap();
        assert!(ctx.superseded.lock().unwrap().is_empty(), "the newer version ends the wait");
    }

    /// A job in Deploying whose two pods are Pending, with the status the
    /// lifecycle keeps for it: deciding again on these pods changes nothing.
    fn pending_job_and_pods() -> (StreamJob, Vec<Pod>) {
        let pods = vec![testing::pod("j", "01234567-1", 0, "Pending", None), testing::pod("j", "01234567-1", 1, "Pending", None)];
        let mut job = job("9", true);
        let mut obs = Observed::at(jiff::Timestamp::now());
        obs.pods = pods.iter().map(PodView::of).collect();
        for _ in 0..4 {
            job.status = Some(crate::lifecycle::decide(&job, &obs, &WorkerSettings::default()).status);
        }
        let again = crate::lifecycle::decide(&job, &obs, &WorkerSettings::default());
        assert!(quiet(&again, job.status.as_ref().unwrap()), "a fixed point: {again:?}");
        assert_eq!(job.status.as_ref().unwrap().run.as_ref().map(|r| r.pods_created), Some(true));
        (job, pods)
    }

    fn pod_cache(pods: &[Pod]) -> Arc<PodCache> {
        let cache = PodCache::default();
        cache.apply(&watcher::Event::Init);
        for p in pods {
            cache.apply(&watcher::Event::InitApply(p.clone()));
        }
        cache.apply(&watcher::Event::InitDone);
        Arc::new(cache)
    }

    fn context_with_pods(pods: &[Pod]) -> (Arc<Context>, Handle) {
        context_on(Some(pods))
    }

    #[tokio::test]
    async fn with_the_pods_in_the_cache_a_reconcile_with_nothing_to_do_makes_no_request() {
        let (job, pods) = pending_job_and_pods();
        let (ctx, mut handle) = context_with_pods(&pods);
        let action = reconcile(Arc::new(job), ctx).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(5)), "waiting for the pods");
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "no list, no write");
    }

    #[tokio::test]
    async fn a_cache_behind_the_api_server_never_decides_an_action_the_listed_pods_decide() {
        let (job, pods) = pending_job_and_pods();
        // The watch has not shown the pods yet: from the cache alone the run's
        // pods would be missing (a failure and a restart).
        let (ctx, mut handle) = context_with_pods(&[]);
        let listed = serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods});
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("a request");
            assert_eq!((req.method().as_str(), req.uri().path()), ("GET", "/api/v1/namespaces/jobs/pods"));
            send.send_response(Response::builder().status(200).body(Body::from(serde_json::to_vec(&listed).unwrap())).unwrap());
            handle
        });
        let action = reconcile(Arc::new(job), ctx).await.unwrap();
        let mut handle = server.await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(5)), "the listed pods are Pending: still waiting");
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "no status write, no restart");
    }

    #[tokio::test]
    async fn a_version_between_the_one_read_and_the_one_written_is_not_reconciled_either() {
        let (ctx, mut handle) = context();
        // Version 7 read, the finalizer written as version 9; meanwhile someone
        // else made version 8, which still has the status of before.
        let server = tokio::spawn(async move {
            answer(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j", &job("9", true)).await;
            handle
        });
        reconcile(Arc::new(job("7", false)), ctx.clone()).await.unwrap();
        let mut handle = server.await.unwrap();
        let action = reconcile(Arc::new(job("8", false)), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(STALE_RETRY));
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "nothing decided on version 8");
        assert!(!ctx.superseded.lock().unwrap().is_empty(), "still waiting for version 9");
    }

    #[tokio::test]
    async fn a_status_write_refused_for_a_changed_job_carries_out_nothing_of_the_decision() {
        // Deciding with the job's pods gone: a failure, a restart.
        let (job, _) = pending_job_and_pods();
        let (ctx, mut handle) = context_with_pods(&[]);
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("the pods are listed");
            assert_eq!(req.uri().path(), "/api/v1/namespaces/jobs/pods");
            let empty = serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []});
            send.send_response(Response::builder().status(200).body(Body::from(serde_json::to_vec(&empty).unwrap())).unwrap());
            let (req, send) = handle.next_request().await.expect("the status write");
            assert_eq!(req.uri().path(), "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j/status");
            let body: serde_json::Value = serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
            assert_eq!(body["metadata"]["resourceVersion"], "9", "the version decided on is a precondition");
            let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409,
                "message": "Operation cannot be fulfilled on streamjobs.weir.dev \"j\": the object has been modified"});
            send.send_response(Response::builder().status(409).body(Body::from(serde_json::to_vec(&conflict).unwrap())).unwrap());
            handle
        });
        let action = reconcile(Arc::new(job), ctx.clone()).await.unwrap();
        let mut handle = server.await.unwrap();
        assert_eq!(action, Action::requeue(STALE_RETRY));
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "no event, no pod deleted or created");
        assert!(ctx.metrics.encode().contains("weir_operator_status_conflicts_total 1"));
    }

    /// Answers the requests of creating a run's objects until none comes
    /// for a moment: the token Secret is not there yet, the ConfigMap and
    /// Service are applied, every pod is refused with `refusal`; returns what
    /// was asked. (The pods go out concurrently: the second may or may not
    /// be sent before the first one's refusal ends the round.)
    async fn refuse_pods(handle: &mut Handle, refusal: serde_json::Value) -> Vec<String> {
        let mut seen = Vec::new();
        while let Ok(Some((req, send))) = tokio::time::timeout(Duration::from_millis(300), handle.next_request()).await {
            let (method, path) = (req.method().to_string(), req.uri().path().to_string());
            let name = path.rsplit('/').next().unwrap_or_default().to_string();
            let (code, body) = match (method.as_str(), path.split('/').rev().nth(1)) {
                ("GET", _) => (404, serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})),
                ("POST", _) if path.ends_with("/secrets") => (201, serde_json::json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "j-operator-token"}})),
                (_, Some("pods")) => (refusal["code"].as_u64().unwrap() as u16, refusal.clone()),
                (_, Some(plural)) => {
                    let kind = match plural {
                        "secrets" => "Secret",
                        "configmaps" => "ConfigMap",
                        "services" => "Service",
                        other => panic!("unexpected {other}"),
                    };
                    (200, serde_json::json!({"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}))
                }
                _ => panic!("unexpected {method} {path}"),
            };
            send.send_response(Response::builder().status(code).body(Body::from(serde_json::to_vec(&body).unwrap())).unwrap());
            seen.push(format!("{method} {path}"));
        }
        seen
    }

    /// The next request, which must be `method path`; answered with 200 and `answer`.
    async fn expect_json(handle: &mut Handle, method: &str, path: &str, answer: serde_json::Value) -> serde_json::Value {
        let (req, send) = handle.next_request().await.expect("a request");
        assert_eq!((req.method().as_str(), req.uri().path()), (method, path));
        let body = req.into_body().collect_bytes().await.unwrap();
        send.send_response(Response::builder().status(200).body(Body::from(serde_json::to_vec(&answer).unwrap())).unwrap());
        if body.is_empty() { serde_json::Value::Null } else { serde_json::from_slice(&body).unwrap() }
    }

    #[tokio::test]
    async fn a_pod_the_api_server_refuses_is_reported_with_its_message_not_as_a_missing_pod() {
        let (ctx, mut handle) = context();
        // Deploying, the run decided and not created yet.
        let mut deploying = job("9", true);
        deploying.status = Some(crate::lifecycle::decide(&deploying, &Observed::at(jiff::Timestamp::now()), &WorkerSettings::default()).status);
        let list = serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []});
        let refusal = serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden", "code": 403,
            "message": "pods \"j-1-0\" is forbidden: violates PodSecurity \"restricted:latest\": allowPrivilegeEscalation != false (container \"shipper\" must set securityContext.allowPrivilegeEscalation=false)"});

        // 1. The run is marked created in status, then its pods are refused.
        let (l, r) = (list.clone(), refusal.clone());
        let written = job("10", true);
        let server = tokio::spawn(async move {
            expect_json(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", l).await;
            let sent = expect_json(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j/status", serde_json::to_value(&written).unwrap()).await;
            assert_eq!(sent["status"]["run"]["podsCreated"], true);
            let seen = refuse_pods(&mut handle, r).await;
            (handle, sent["status"].clone(), seen)
        });
        let result = reconcile(Arc::new(deploying), ctx.clone()).await;
        let (mut handle, status, seen) = server.await.unwrap();
        assert!(seen.contains(&"PATCH /api/v1/namespaces/jobs/pods/j-1-0".to_string()), "{seen:?} {result:?}");
        let err = result.expect_err("the refusal is a failed reconcile (logged, counted, retried)").to_string();
        assert!(err.contains("violates PodSecurity"), "{err}");
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending());

        // 2. The next reconcile says so: status first, then a Warning event with
        // the API server's message; no restart, no Recovering, nothing deleted.
        let mut created = job("10", true);
        created.status = Some(serde_json::from_value(status).unwrap());
        let server = tokio::spawn(async move {
            expect_json(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", list).await;
            let sent = expect_json(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j/status", serde_json::to_value(job("11", true)).unwrap()).await;
            let event = expect_json(&mut handle, "POST", "/apis/events.k8s.io/v1/namespaces/jobs/events", serde_json::json!({})).await;
            (handle, sent["status"].clone(), event)
        });
        reconcile(Arc::new(created), ctx.clone()).await.unwrap();
        let (mut handle, status, event) = server.await.unwrap();
        assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "nothing else: no pod deleted, none created yet");
        assert_eq!(status["phase"], "Deploying");
        assert_eq!(status["restarts"], 0);
        assert_eq!(status["run"]["podsCreated"], false);
        assert_eq!(status["run"]["refusals"], 1);
        let degraded = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Degraded").unwrap().clone();
        assert_eq!((degraded["status"].as_str(), degraded["reason"].as_str()), (Some("True"), Some("PodRejected")));
        let message = degraded["message"].as_str().unwrap();
        assert!(message.starts_with("the API server refused worker pod j-1-0 (403 Forbidden): pods \"j-1-0\" is forbidden: violates PodSecurity"), "{message}");
        assert_eq!((event["type"].as_str(), event["reason"].as_str()), (Some("Warning"), Some("PodRejected")));
        assert!(event["note"].as_str().unwrap().contains("must set securityContext.allowPrivilegeEscalation=false"), "{event}");
    }

    #[test]
    fn only_a_pod_refused_by_the_api_server_is_a_pod_rejection() {
        let api = |code: u16| {
            let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "no", "reason": "Forbidden", "code": code});
            kube::Error::Api(Box::new(serde_json::from_value(status).unwrap()))
        };
        let pod = |code| Error::kube(format!("{APPLYING_POD}j-1-0"))(api(code));
        for code in [400, 403, 404, 422] {
            assert_eq!(rejection("r", &pod(code)).reason, "PodRejected", "{code}");
        }
        assert_eq!(rejection("r", &pod(500)).reason, "RunNotCreated");
        assert_eq!(rejection("r", &pod(429)).reason, "RunNotCreated");
        let cm = Error::kube("applying the pipeline ConfigMap")(api(403));
        let r = rejection("r", &cm);
        assert_eq!((r.reason.as_str(), r.run_id.as_str()), ("RunNotCreated", "r"));
        assert!(r.message.contains("applying the pipeline ConfigMap"), "{}", r.message);
    }

    #[tokio::test]
    async fn a_write_that_changed_nothing_does_not_hold_the_next_reconcile() {
        let (ctx, mut handle) = context();
        let server = tokio::spawn(async move {
            // The API server answers with the same version: nothing changed.
            answer(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j", &job("7", true)).await;
            handle
        });
        reconcile(Arc::new(job("7", false)), ctx.clone()).await.unwrap();
        server.await.unwrap();
        assert!(ctx.superseded.lock().unwrap().is_empty());
    }
}
