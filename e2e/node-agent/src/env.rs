//! A container's environment, as the kubelet builds it: envFrom, env (values,
//! fieldRef, secretKeyRef, configMapKeyRef, `$(VAR)` expansion), plus what
//! in-cluster clients need to find the API server.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Container, Pod};

/// The data of the ConfigMaps and Secrets a pod refers to, fetched before
/// the pod starts (Secrets already decoded).
#[derive(Debug, Default, Clone)]
pub struct Refs {
    pub config_maps: HashMap<String, BTreeMap<String, String>>,
    pub secrets: HashMap<String, BTreeMap<String, String>>,
}

/// What the node knows about the pod beyond its spec.
#[derive(Debug, Clone)]
pub struct PodContext {
    pub pod_ip: String,
    pub host_ip: String,
    pub node_name: String,
    pub apiserver_port: u16,
}

/// Names of the ConfigMaps and Secrets the pod's env, envFrom and volumes use.
pub fn referenced(pod: &Pod) -> (Vec<String>, Vec<String>) {
    let mut cms = Vec::new();
    let mut secrets = Vec::new();
    let Some(spec) = &pod.spec else {
        return (cms, secrets);
    };
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        for e in c.env.iter().flatten() {
            if let Some(vf) = &e.value_from {
                if let Some(r) = &vf.config_map_key_ref {
                    cms.push(r.name.clone());
                }
                if let Some(r) = &vf.secret_key_ref {
                    secrets.push(r.name.clone());
                }
            }
        }
        for ef in c.env_from.iter().flatten() {
            if let Some(r) = &ef.config_map_ref {
                cms.push(r.name.clone());
            }
            if let Some(r) = &ef.secret_ref {
                secrets.push(r.name.clone());
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        if let Some(cm) = &v.config_map {
            cms.push(cm.name.clone());
        }
        if let Some(s) = &v.secret {
            secrets.extend(s.secret_name.clone());
        }
        for src in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
            if let Some(cm) = &src.config_map {
                cms.push(cm.name.clone());
            }
            if let Some(s) = &src.secret {
                secrets.push(s.name.clone());
            }
        }
    }
    cms.sort();
    cms.dedup();
    secrets.sort();
    secrets.dedup();
    (cms, secrets)
}

/// The value of a downward-API field path, as the kubelet gives it.
pub fn field_value(pod: &Pod, ctx: &PodContext, path: &str) -> Result<String, String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let keyed = |prefix: &str, map: Option<&BTreeMap<String, String>>| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.and_then(|m| m.get(key)).cloned().unwrap_or_default())
    };
    if let Some(v) = keyed("metadata.labels['", meta.labels.as_ref()) {
        return Ok(v);
    }
    if let Some(v) = keyed("metadata.annotations['", meta.annotations.as_ref()) {
        return Ok(v);
    }
    let fmt_map = |m: Option<&BTreeMap<String, String>>| {
        m.into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => fmt_map(meta.labels.as_ref()),
        "metadata.annotations" => fmt_map(meta.annotations.as_ref()),
        "spec.nodeName" => ctx.node_name.clone(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" | "status.podIPs" => ctx.pod_ip.clone(),
        "status.hostIP" | "status.hostIPs" => ctx.host_ip.clone(),
        other => return Err(format!("unsupported fieldRef fieldPath {other:?}")),
    })
}

/// Kubernetes' `$(VAR)` expansion: a defined variable is replaced, an
/// undefined reference is left as written, `$$` is a literal `$`.
pub fn expand(s: &str, vars: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(j) => {
                    let name = &body[..j];
                    match vars.get(name) {
                        Some(v) => out.push_str(v),
                        None => out.push_str(&rest[i..i + 3 + j]),
                    }
                    rest = &body[j + 1..];
                }
                None => {
                    out.push_str(&rest[i..]);
                    rest = "";
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The environment of one container, in order (later entries win). Err when
/// a non-optional reference cannot be resolved: the kubelet's
/// CreateContainerConfigError.
pub fn container_env(
    pod: &Pod,
    c: &Container,
    ctx: &PodContext,
    refs: &Refs,
) -> Result<Vec<(String, String)>, String> {
    let mut env: Vec<(String, String)> = vec![
        ("KUBERNETES_SERVICE_HOST".into(), "127.0.0.1".into()),
        (
            "KUBERNETES_SERVICE_PORT".into(),
            ctx.apiserver_port.to_string(),
        ),
        (
            "KUBERNETES_SERVICE_PORT_HTTPS".into(),
            ctx.apiserver_port.to_string(),
        ),
        (
            "KUBERNETES_PORT".into(),
            format!("tcp://127.0.0.1:{}", ctx.apiserver_port),
        ),
        ("POD_IP".into(), ctx.pod_ip.clone()),
        (
            "HOSTNAME".into(),
            pod.metadata.name.clone().unwrap_or_default(),
        ),
    ];
    for ef in c.env_from.iter().flatten() {
        let prefix = ef.prefix.clone().unwrap_or_default();
        let (data, optional, what, name) = if let Some(r) = &ef.config_map_ref {
            (
                refs.config_maps.get(&r.name),
                r.optional.unwrap_or(false),
                "configmap",
                &r.name,
            )
        } else if let Some(r) = &ef.secret_ref {
            (
                refs.secrets.get(&r.name),
                r.optional.unwrap_or(false),
                "secret",
                &r.name,
            )
        } else {
            continue;
        };
        match data {
            Some(d) => env.extend(d.iter().map(|(k, v)| (format!("{prefix}{k}"), v.clone()))),
            None if optional => {}
            None => return Err(format!("{what} {name:?} not found")),
        }
    }
    let mut vars: HashMap<String, String> = env.iter().cloned().collect();
    for e in c.env.iter().flatten() {
        let value = if let Some(vf) = &e.value_from {
            if let Some(f) = &vf.field_ref {
                Some(field_value(pod, ctx, &f.field_path)?)
            } else if let Some(r) = &vf.config_map_key_ref {
                lookup(&refs.config_maps, "configmap", &r.name, &r.key, r.optional)?
            } else if let Some(r) = &vf.secret_key_ref {
                lookup(&refs.secrets, "secret", &r.name, &r.key, r.optional)?
            } else if let Some(r) = &vf.resource_field_ref {
                Some(resource_value(c, &r.resource))
            } else {
                return Err(format!("env {:?}: unsupported valueFrom", e.name));
            }
        } else {
            Some(expand(e.value.as_deref().unwrap_or(""), &vars))
        };
        if let Some(v) = value {
            vars.insert(e.name.clone(), v.clone());
            env.push((e.name.clone(), v));
        }
    }
    Ok(env)
}

fn lookup(
    maps: &HashMap<String, BTreeMap<String, String>>,
    what: &str,
    name: &str,
    key: &str,
    optional: Option<bool>,
) -> Result<Option<String>, String> {
    match maps.get(name).and_then(|d| d.get(key)) {
        Some(v) => Ok(Some(v.clone())),
        None if optional.unwrap_or(false) => Ok(None),
        None if maps.contains_key(name) => Err(format!("key {key:?} not found in {what} {name:?}")),
        None => Err(format!("{what} {name:?} not found")),
    }
}

/// resourceFieldRef: the container's limit or request as written (no
/// divisor handling), "0" when unset.
fn resource_value(c: &Container, resource: &str) -> String {
    let r = c.resources.as_ref();
    let (map, key) = match resource.split_once('.') {
        Some(("limits", k)) => (r.and_then(|r| r.limits.as_ref()), k),
        Some(("requests", k)) => (r.and_then(|r| r.requests.as_ref()), k),
        _ => (None, ""),
    };
    map.and_then(|m| m.get(key))
        .map(|q| q.0.clone())
        .unwrap_or_else(|| "0".into())
}

/// Command and args with `$(VAR)` expanded from the container's environment.
pub fn expand_all(items: &[String], env: &[(String, String)]) -> Vec<String> {
    let vars: HashMap<String, String> = env.iter().cloned().collect();
    items.iter().map(|s| expand(s, &vars)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p1", "namespace": "ns1", "uid": "u-1", "labels": {"app": "w"}},
            "spec": {
                "nodeName": "n1",
                "serviceAccountName": "sa1",
                "containers": [{
                    "name": "c",
                    "image": "weir",
                    "args": ["--listen", "$(POD_IP):9000", "$$(POD_IP)", "$(NOPE)"],
                    "env": [
                        {"name": "A", "value": "plain"},
                        {"name": "B", "value": "$(A)-x"},
                        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                        {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
                        {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                        {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "x", "optional": true}}}
                    ],
                    "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CFG_"}]
                }],
                "volumes": [{"name": "v", "secret": {"secretName": "s"}}]
            }
        }))
        .unwrap()
    }

    fn ctx() -> PodContext {
        PodContext {
            pod_ip: "127.0.1.7".into(),
            host_ip: "127.0.0.1".into(),
            node_name: "n1".into(),
            apiserver_port: 6443,
        }
    }

    fn refs() -> Refs {
        let mut r = Refs::default();
        r.config_maps
            .insert("cm".into(), [("k".to_string(), "cmv".to_string())].into());
        r.secrets.insert(
            "s".into(),
            [("pw".to_string(), "hunter2".to_string())].into(),
        );
        r
    }

    #[test]
    fn resolves_values_fields_and_refs() {
        let p = pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let env: HashMap<_, _> = container_env(&p, c, &ctx(), &refs())
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(env["A"], "plain");
        assert_eq!(env["B"], "plain-x");
        assert_eq!(env["NAME"], "p1");
        assert_eq!(env["NS"], "ns1");
        assert_eq!(env["IP"], "127.0.1.7");
        assert_eq!(env["POD_IP"], "127.0.1.7");
        assert_eq!(env["NODE"], "n1");
        assert_eq!(env["APP"], "w");
        assert_eq!(env["CM"], "cmv");
        assert_eq!(env["CFG_k"], "cmv");
        assert_eq!(env["S"], "hunter2");
        assert!(!env.contains_key("OPT"));
        assert_eq!(env["KUBERNETES_SERVICE_HOST"], "127.0.0.1");
        assert_eq!(env["KUBERNETES_SERVICE_PORT"], "6443");
    }

    #[test]
    fn missing_reference_is_an_error() {
        let p = pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let mut r = refs();
        r.secrets.clear();
        assert_eq!(
            container_env(&p, c, &ctx(), &r).unwrap_err(),
            "secret \"s\" not found"
        );
        let mut r = refs();
        r.config_maps.get_mut("cm").unwrap().clear();
        assert!(container_env(&p, c, &ctx(), &r)
            .unwrap_err()
            .contains("key \"k\" not found"));
    }

    #[test]
    fn args_are_expanded() {
        let p = pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let env = container_env(&p, c, &ctx(), &refs()).unwrap();
        let args = expand_all(c.args.as_ref().unwrap(), &env);
        assert_eq!(args, ["--listen", "127.0.1.7:9000", "$(POD_IP)", "$(NOPE)"]);
        assert_eq!(expand("a$b$(", &HashMap::new()), "a$b$(");
    }

    #[test]
    fn referenced_objects() {
        let (cms, secrets) = referenced(&pod());
        assert_eq!(cms, ["cm"]);
        assert_eq!(secrets, ["gone", "s"]);
    }
}
