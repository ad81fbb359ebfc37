//! One reconcile of one StreamJob: observe, decide, write status, act.
//! The deciding is in [`crate::lifecycle`]; this module only talks to the
//! API server and the workers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use tracing::{debug, info, instrument, warn};
use weir_api::control::{SavepointRequest, CONTROL_PORT};
use weir_api::streamjob::{StreamJob, StreamJobStatus};

use crate::context::Context;
use crate::desired;
use crate::error::{Error, Result};
use crate::lifecycle::{self, Decision, Effect};
use crate::names;
use crate::observe::{Observed, PodView, RunHealth};
use crate::FIELD_MANAGER;

#[instrument(skip_all, fields(job = %job.name_any(), namespace = job.namespace().unwrap_or_default()))]
pub async fn reconcile(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    let result = reconcile_inner(&job, &ctx).await;
    ctx.metrics.reconciled(started.elapsed(), result.as_ref().err());
    result
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
        let patch = serde_json::json!({"metadata": {"finalizers": [names::FINALIZER]}});
        jobs.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(Error::kube("adding the finalizer"))?;
        return Ok(Action::requeue(Duration::ZERO));
    }

    let observed = observe(job, ctx, &ns).await?;
    let decision = lifecycle::decide(job, &observed);
    let old = job.status.clone().unwrap_or_default();
    if decision.status != old {
        write_status(&jobs, &name, &decision.status).await?;
    }
    if let Some((from, to, spent)) = &decision.transition {
        info!(from = ?from, to = ?to, spent_ms = spent.as_millis() as u64, message = decision.status.message.as_deref().unwrap_or(""), "phase changed");
        ctx.metrics.transition(*from, *to, *spent);
    }
    ctx.metrics.set_phase(job, decision.status.phase);
    publish(ctx, job, &decision).await;
    act(job, ctx, &ns, &decision).await?;
    Ok(Action::requeue(decision.requeue))
}

async fn observe(job: &StreamJob, ctx: &Context, ns: &str) -> Result<Observed> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&names::job_selector(&job.name_any())))
        .await
        .map_err(Error::kube("listing the job's pods"))?;
    let mut observed = Observed::at(jiff::Timestamp::now());
    observed.pods = list.items.iter().map(PodView::of).collect();
    let status = job.status.clone().unwrap_or_default();
    let Some(run) = &status.run else { return Ok(observed) };
    let RunHealth::Running { ips } = observed.health(run) else { return Ok(observed) };
    let Some(ip) = ips.first() else { return Ok(observed) };
    let api = SocketAddr::new(*ip, CONTROL_PORT);
    let token = token(job, ctx, ns).await?;
    match ctx.workers.status(api, &token).await {
        Ok(s) => observed.coordinator = Some(s),
        Err(e) => {
            debug!(error = %e, "coordinator did not answer");
            observed.coordinator_error = Some(e.to_string());
        }
    }
    if let Some(id) = status.pending_savepoint.as_ref().and_then(|p| p.request_id.as_deref()) {
        if observed.coordinator.is_some() {
            match ctx.workers.savepoint_outcome(api, &token, id).await {
                Ok(o) => observed.savepoint = Some(o),
                Err(e) => debug!(error = %e, "savepoint outcome not available"),
            }
        }
    }
    Ok(observed)
}

async fn write_status(jobs: &Api<StreamJob>, name: &str, status: &StreamJobStatus) -> Result<()> {
    let patch = serde_json::json!({
        "apiVersion": "weir.dev/v1alpha1",
        "kind": "StreamJob",
        "status": status,
    });
    jobs.patch_status(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .map_err(Error::kube("writing the status"))?;
    Ok(())
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

async fn act(job: &StreamJob, ctx: &Context, ns: &str, decision: &Decision) -> Result<()> {
    for effect in &decision.effects {
        match effect {
            Effect::CreateRun => create_run(job, ctx, ns, &decision.status).await?,
            Effect::DeleteOtherPods => delete_pods(job, ctx, ns, decision.status.run.as_ref().map(|r| r.id.as_str())).await?,
            Effect::DeleteAllPods => delete_pods(job, ctx, ns, None).await?,
            Effect::SendMembership { membership, workers } => {
                let token = token(job, ctx, ns).await?;
                for w in workers {
                    if let Err(e) = ctx.workers.put_membership(*w, &token, membership).await {
                        // Not started listening yet: the next reconcile sends again.
                        debug!(worker = %w, error = %e, "membership not delivered yet");
                    }
                }
            }
            Effect::RequestSavepoint { api, request_id, stop } => {
                let token = token(job, ctx, ns).await?;
                let request = SavepointRequest { request_id: Some(request_id.clone()), stop: *stop };
                match ctx.workers.request_savepoint(*api, &token, &request).await {
                    Ok(o) => debug!(request = %request_id, state = ?o.state, "savepoint requested"),
                    // Retried by the waiting state until spec.savepointTimeout.
                    Err(e) => warn!(request = %request_id, error = %e, "savepoint request not accepted yet"),
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
            }
        }
    }
    Ok(())
}

async fn create_run(job: &StreamJob, ctx: &Context, ns: &str, status: &StreamJobStatus) -> Result<()> {
    let Some(run) = &status.run else { return Ok(()) };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    token(job, ctx, ns).await?;
    let cm = desired::pipeline_config_map(job)?;
    Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(ctx.client.clone(), ns)
        .patch(&cm.name_any(), &apply, &Patch::Apply(&cm))
        .await
        .map_err(Error::kube("applying the pipeline ConfigMap"))?;
    let svc = desired::workers_service(job)?;
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(ctx.client.clone(), ns)
        .patch(&svc.name_any(), &apply, &Patch::Apply(&svc))
        .await
        .map_err(Error::kube("applying the workers Service"))?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    for index in 0..run.workers.max(0) as u32 {
        let pod = desired::worker_pod(job, run, index, &ctx.settings)?;
        pods.patch(&pod.name_any(), &apply, &Patch::Apply(&pod)).await.map_err(Error::kube(format!("applying pod {}", pod.name_any())))?;
    }
    info!(run = %run.id, workers = run.workers, restore = run.restore_from.as_deref().unwrap_or("none"), "created the run's pods");
    Ok(())
}

/// Deletes the job's pods, except those of `keep_run`.
async fn delete_pods(job: &StreamJob, ctx: &Context, ns: &str, keep_run: Option<&str>) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&names::job_selector(&job.name_any())))
        .await
        .map_err(Error::kube("listing the job's pods"))?;
    for pod in list.items {
        let run = pod.labels().get(names::RUN_LABEL).map(String::as_str);
        if keep_run.is_some() && run == keep_run || pod.meta().deletion_timestamp.is_some() {
            continue;
        }
        match pods.delete(&pod.name_any(), &DeleteParams::default()).await {
            Ok(_) => info!(pod = %pod.name_any(), "deleted a pod"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(Error::kube(format!("deleting pod {}", pod.name_any()))(e)),
        }
    }
    Ok(())
}

/// The job's control token: from the cache, its Secret, or a new Secret.
async fn token(job: &StreamJob, ctx: &Context, ns: &str) -> Result<String> {
    let uid = job.uid().unwrap_or_default();
    if let Some(t) = ctx.tokens.lock().ok().and_then(|m| m.get(&uid).cloned()) {
        return Ok(t);
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = names::token_secret(&job.name_any());
    let existing = secrets.get_opt(&name).await.map_err(Error::kube("reading the control token Secret"))?;
    let token = match existing.and_then(|s| s.data).and_then(|d| d.get(names::TOKEN_KEY).cloned()) {
        Some(bytes) => String::from_utf8_lossy(&bytes.0).into_owned(),
        None => {
            let token = desired::new_token();
            let secret = desired::token_secret(job, &token)?;
            secrets
                .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&secret))
                .await
                .map_err(Error::kube("creating the control token Secret"))?;
            token
        }
    };
    if let Ok(mut m) = ctx.tokens.lock() {
        m.insert(uid, token.clone());
    }
    Ok(token)
}

/// Failed reconciles are retried soon; the error is in the log and metrics.
pub fn error_policy(job: Arc<StreamJob>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(job = %job.name_any(), error = %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}
