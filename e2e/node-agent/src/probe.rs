//! Readiness and liveness probes: httpGet (plain HTTP; an HTTPS probe only
//! checks that the port accepts a connection), tcpSocket and exec (run in the
//! container's mount namespace with nsenter). gRPC probes are not supported
//! (treated as tcpSocket on their port).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Readiness,
    Liveness,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Check {
    Tcp(SocketAddr),
    Http {
        addr: SocketAddr,
        path: String,
        headers: Vec<(String, String)>,
    },
    Exec(Vec<String>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ProbeCfg {
    pub check: Check,
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

fn port_of(c: &Container, p: &IntOrString) -> Result<u16, String> {
    match p {
        IntOrString::Int(n) => {
            u16::try_from(*n).map_err(|_| format!("probe port {n} is out of range"))
        }
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name))
            .and_then(|cp| u16::try_from(cp.container_port).ok())
            .ok_or_else(|| {
                format!(
                    "probe port {name:?} is not a named port of container {:?}",
                    c.name
                )
            }),
    }
}

/// The probe's configuration with the kubelet's defaults (period 10 s,
/// timeout 1 s, thresholds 1 and 3). Addresses default to the pod IP.
pub fn config(c: &Container, p: &Probe, pod_ip: IpAddr) -> Result<ProbeCfg, String> {
    let host = |h: Option<&String>| -> Result<IpAddr, String> {
        match h.filter(|h| !h.is_empty()) {
            None => Ok(pod_ip),
            Some(h) if h == "localhost" => Ok(pod_ip),
            Some(h) => h
                .parse()
                .map_err(|_| format!("probe host {h:?} is not an IP address (no DNS here)")),
        }
    };
    let check = if let Some(h) = &p.http_get {
        let addr = SocketAddr::new(host(h.host.as_ref())?, port_of(c, &h.port)?);
        if h.scheme
            .as_deref()
            .is_some_and(|s| s.eq_ignore_ascii_case("https"))
        {
            Check::Tcp(addr)
        } else {
            Check::Http {
                addr,
                path: h
                    .path
                    .clone()
                    .filter(|p| !p.is_empty())
                    .unwrap_or_else(|| "/".into()),
                headers: h
                    .http_headers
                    .iter()
                    .flatten()
                    .map(|x| (x.name.clone(), x.value.clone()))
                    .collect(),
            }
        }
    } else if let Some(t) = &p.tcp_socket {
        Check::Tcp(SocketAddr::new(
            host(t.host.as_ref())?,
            port_of(c, &t.port)?,
        ))
    } else if let Some(e) = &p.exec {
        Check::Exec(e.command.clone().unwrap_or_default())
    } else if let Some(g) = &p.grpc {
        let port = u16::try_from(g.port).map_err(|_| "grpc probe port out of range".to_string())?;
        Check::Tcp(SocketAddr::new(pod_ip, port))
    } else {
        return Err("probe has no handler".into());
    };
    let secs = |v: Option<i32>, d: i32| Duration::from_secs(v.unwrap_or(d).max(0) as u64);
    Ok(ProbeCfg {
        check,
        initial_delay: secs(p.initial_delay_seconds, 0),
        period: secs(p.period_seconds, 10).max(Duration::from_secs(1)),
        timeout: secs(p.timeout_seconds, 1).max(Duration::from_secs(1)),
        success_threshold: p.success_threshold.unwrap_or(1).max(1) as u32,
        failure_threshold: p.failure_threshold.unwrap_or(3).max(1) as u32,
    })
}

/// Consecutive results -> state changes, per the thresholds.
#[derive(Debug)]
pub struct Counter {
    pub ok: bool,
    successes: u32,
    failures: u32,
    success_threshold: u32,
    failure_threshold: u32,
}

impl Counter {
    pub fn new(initial: bool, success_threshold: u32, failure_threshold: u32) -> Self {
        Self {
            ok: initial,
            successes: 0,
            failures: 0,
            success_threshold,
            failure_threshold,
        }
    }

    /// Record one result; Some(new state) when the state flips.
    pub fn observe(&mut self, success: bool) -> Option<bool> {
        if success {
            self.failures = 0;
            self.successes += 1;
            if !self.ok && self.successes >= self.success_threshold {
                self.ok = true;
                return Some(true);
            }
        } else {
            self.successes = 0;
            self.failures += 1;
            if self.ok && self.failures >= self.failure_threshold {
                self.ok = false;
                return Some(false);
            }
        }
        None
    }
}

/// Status code of an HTTP/1.x response's status line.
pub fn http_status(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

async fn http_get(
    addr: SocketAddr,
    path: &str,
    headers: &[(String, String)],
) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.36\r\nAccept: */*\r\nConnection: close\r\n");
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 256];
    let mut n = 0;
    while n < buf.len() && !buf[..n].contains(&b'\n') {
        let r = s.read(&mut buf[n..]).await.map_err(|e| e.to_string())?;
        if r == 0 {
            break;
        }
        n += r;
    }
    match http_status(&buf[..n]) {
        Some(code) if (200..400).contains(&code) => Ok(()),
        Some(code) => Err(format!("HTTP probe failed with statuscode: {code}")),
        None => Err("no HTTP response".into()),
    }
}

/// Run one check. `pid` is the container's process, for exec probes.
pub async fn check_once(
    cfg: &ProbeCfg,
    pid: i32,
    env: &[(String, String)],
    mount_ns: bool,
) -> Result<(), String> {
    let fut = async {
        match &cfg.check {
            Check::Tcp(addr) => TcpStream::connect(addr)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Check::Http {
                addr,
                path,
                headers,
            } => http_get(*addr, path, headers).await,
            Check::Exec(argv) => {
                let mut cmd = if mount_ns {
                    let mut c = tokio::process::Command::new("nsenter");
                    c.arg("--mount")
                        .arg("--target")
                        .arg(pid.to_string())
                        .arg("--")
                        .args(argv);
                    c
                } else {
                    let Some((p, a)) = argv.split_first() else {
                        return Err("empty exec probe".into());
                    };
                    let mut c = tokio::process::Command::new(p);
                    c.args(a);
                    c
                };
                let st = cmd
                    .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .kill_on_drop(true)
                    .status()
                    .await
                    .map_err(|e| e.to_string())?;
                if st.success() {
                    Ok(())
                } else {
                    Err(format!("exec probe exited with {st}"))
                }
            }
        }
    };
    tokio::time::timeout(cfg.timeout, fut)
        .await
        .unwrap_or_else(|_| Err("probe timed out".into()))
}

#[derive(Debug)]
pub struct ProbeEvent {
    pub idx: usize,
    pub seq: u64,
    pub kind: Kind,
    pub ok: bool,
    pub message: String,
}

/// Probe forever; report each state flip (readiness starts not ready,
/// liveness starts alive). The pod task aborts this task when the process
/// exits.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    cfg: ProbeCfg,
    kind: Kind,
    idx: usize,
    seq: u64,
    pid: i32,
    env: Vec<(String, String)>,
    mount_ns: bool,
    tx: mpsc::UnboundedSender<ProbeEvent>,
) {
    let mut counter = Counter::new(
        kind == Kind::Liveness,
        cfg.success_threshold,
        cfg.failure_threshold,
    );
    tokio::time::sleep(cfg.initial_delay).await;
    loop {
        let r = check_once(&cfg, pid, &env, mount_ns).await;
        let message = r.as_ref().err().cloned().unwrap_or_default();
        if let Some(ok) = counter.observe(r.is_ok()) {
            if tx
                .send(ProbeEvent {
                    idx,
                    seq,
                    kind,
                    ok,
                    message,
                })
                .is_err()
            {
                return;
            }
        }
        tokio::time::sleep(cfg.period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn container() -> Container {
        serde_json::from_value(
            json!({"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}),
        )
        .unwrap()
    }

    #[test]
    fn config_defaults_and_named_ports() {
        let p: Probe =
            serde_json::from_value(json!({"httpGet": {"path": "/readyz", "port": "http"}}))
                .unwrap();
        let ip: IpAddr = "127.0.1.9".parse().unwrap();
        let cfg = config(&container(), &p, ip).unwrap();
        assert_eq!(
            cfg.check,
            Check::Http {
                addr: "127.0.1.9:8080".parse().unwrap(),
                path: "/readyz".into(),
                headers: vec![]
            }
        );
        assert_eq!(cfg.period, Duration::from_secs(10));
        assert_eq!((cfg.success_threshold, cfg.failure_threshold), (1, 3));
        let p: Probe =
            serde_json::from_value(json!({"tcpSocket": {"port": 9}, "periodSeconds": 2})).unwrap();
        let cfg = config(&container(), &p, ip).unwrap();
        assert_eq!(cfg.check, Check::Tcp("127.0.1.9:9".parse().unwrap()));
        assert_eq!(cfg.period, Duration::from_secs(2));
        let p: Probe = serde_json::from_value(json!({"tcpSocket": {"port": "nope"}})).unwrap();
        assert!(config(&container(), &p, ip).unwrap_err().contains("nope"));
        let p: Probe =
            serde_json::from_value(json!({"httpGet": {"port": 443, "scheme": "HTTPS"}})).unwrap();
        assert_eq!(
            config(&container(), &p, ip).unwrap().check,
            Check::Tcp("127.0.1.9:443".parse().unwrap())
        );
    }

    #[test]
    fn thresholds() {
        let mut c = Counter::new(false, 2, 3);
        assert_eq!(c.observe(true), None);
        assert_eq!(c.observe(true), Some(true));
        assert_eq!(c.observe(true), None);
        assert_eq!(c.observe(false), None);
        assert_eq!(c.observe(false), None);
        assert_eq!(c.observe(true), None); // resets the failure run
        assert_eq!(c.observe(false), None);
        assert_eq!(c.observe(false), None);
        assert_eq!(c.observe(false), Some(false));
    }

    #[test]
    fn status_line() {
        assert_eq!(http_status(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(
            http_status(b"HTTP/1.0 503 Service Unavailable\r\nx"),
            Some(503)
        );
        assert_eq!(http_status(b"garbage"), None);
    }

    #[tokio::test]
    async fn http_and_tcp_checks_against_a_local_server() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            for code in [200, 500] {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 512];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\n\r\n").as_bytes())
                    .await;
            }
        });
        let cfg = |check| ProbeCfg {
            check,
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            success_threshold: 1,
            failure_threshold: 1,
        };
        let http = cfg(Check::Http {
            addr,
            path: "/".into(),
            headers: vec![],
        });
        assert!(check_once(&http, 0, &[], false).await.is_ok());
        assert!(check_once(&http, 0, &[], false)
            .await
            .unwrap_err()
            .contains("500"));
        let closed = cfg(Check::Tcp("127.0.0.1:1".parse().unwrap()));
        assert!(check_once(&closed, 0, &[], false).await.is_err());
        let exec = cfg(Check::Exec(vec!["true".into()]));
        assert!(check_once(&exec, 0, &[], false).await.is_ok());
        let exec = cfg(Check::Exec(vec!["false".into()]));
        assert!(check_once(&exec, 0, &[], false).await.is_err());
    }
}
