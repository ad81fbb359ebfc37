//! Listening sockets that the local supervisor binds and its workers inherit.
//!
//! Picking a free port by binding port 0, closing the socket and letting a
//! worker bind the number later is a race: in between, any other process on
//! the machine (another job, a test running beside this one, an outgoing
//! connection's ephemeral port) can take it, and the worker fails with
//! "address already in use". The supervisor therefore keeps every listener
//! of an attempt open from the moment it picks the address, and hands each
//! to the worker that serves it as an inherited file descriptor named in
//! `WEIR_INHERITED_LISTENERS` (`ADDR=FD,…`). The port is never free in
//! between, so nothing else can take it.
//!
//! A worker started any other way (pod mode, by hand) has no such variable
//! and binds its addresses itself.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// The environment variable that names inherited listeners.
pub const ENV: &str = "WEIR_INHERITED_LISTENERS";

/// Listeners bound by the supervisor for one attempt, kept open until every
/// worker of it has started.
#[derive(Default)]
pub struct Listeners {
    bound: Vec<TcpListener>,
}

impl Listeners {
    /// Binds a free loopback port and keeps it open.
    pub fn bind_free(&mut self) -> Result<SocketAddr> {
        let l = TcpListener::bind("127.0.0.1:0").map_err(Error::io("binding a free loopback port"))?;
        let addr = l.local_addr().map_err(Error::io("binding a free loopback port"))?;
        self.bound.push(l);
        Ok(addr)
    }

    /// What a worker serving `addrs` inherits: the value of [`ENV`] and a
    /// closure for `pre_exec` that clears close-on-exec on those sockets
    /// only (in the child, after fork).
    pub fn for_worker(&self, addrs: &[SocketAddr]) -> (String, impl Fn() -> std::io::Result<()> + Send + Sync + 'static) {
        let fds: Vec<(SocketAddr, RawFd)> = self
            .bound
            .iter()
            .filter_map(|l| l.local_addr().ok().filter(|a| addrs.contains(a)).map(|a| (a, l.as_raw_fd())))
            .collect();
        let env = fds.iter().map(|(a, fd)| format!("{a}={fd}")).collect::<Vec<_>>().join(",");
        let keep = move || fds.iter().try_for_each(|(_, fd)| super::keep_open_across_exec(*fd));
        (env, keep)
    }
}

/// Inherited listeners not yet taken, parsed once from [`ENV`].
static INHERITED: Mutex<Option<HashMap<SocketAddr, RawFd>>> = Mutex::new(None);

/// The inherited listener for `addr`, if the supervisor handed one over; each
/// is taken at most once. A malformed variable is an error naming it.
pub fn take(addr: SocketAddr) -> Result<Option<TcpListener>> {
    let mut guard = INHERITED.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(parse(&std::env::var(ENV).unwrap_or_default())?);
    }
    let Some(fd) = guard.as_mut().and_then(|m| m.remove(&addr)) else { return Ok(None) };
    // Safety: the supervisor passed this descriptor for this address, it is
    // open in this process, and removing it from the table means it is
    // wrapped only once.
    let l = unsafe { TcpListener::from_raw_fd(fd) };
    match l.local_addr() {
        Ok(a) if a == addr => Ok(Some(l)),
        Ok(a) => Err(Error::Job(format!("{ENV}: descriptor {fd} listens on {a}, not on {addr}"))),
        Err(e) => Err(Error::Job(format!("{ENV}: descriptor {fd} for {addr} is not a listening socket: {e}"))),
    }
}

fn parse(value: &str) -> Result<HashMap<SocketAddr, RawFd>> {
    let mut map = HashMap::new();
    for item in value.split(',').filter(|s| !s.is_empty()) {
        let parsed = item.rsplit_once('=').and_then(|(a, fd)| Some((a.parse::<SocketAddr>().ok()?, fd.parse::<RawFd>().ok()?)));
        let Some((addr, fd)) = parsed else {
            return Err(Error::Job(format!("{ENV}: `{item}` is not ADDRESS=DESCRIPTOR (for example 127.0.0.1:4000=5)")));
        };
        map.insert(addr, fd);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_names_each_address_with_its_descriptor() {
        let m = parse("127.0.0.1:4000=5,[::1]:4001=6").unwrap();
        assert_eq!(m[&"127.0.0.1:4000".parse().unwrap()], 5);
        assert_eq!(m[&"[::1]:4001".parse().unwrap()], 6);
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn a_malformed_variable_is_refused_naming_it_and_the_item() {
        let e = parse("127.0.0.1:4000").unwrap_err().to_string();
        assert!(e.contains(ENV) && e.contains("127.0.0.1:4000"), "{e}");
    }

    #[test]
    fn a_worker_gets_only_the_listeners_of_its_own_addresses() {
        let mut l = Listeners::default();
        let a = l.bind_free().unwrap();
        let b = l.bind_free().unwrap();
        let (env, _) = l.for_worker(&[b]);
        assert!(env.starts_with(&format!("{b}=")) && !env.contains(&a.to_string()), "{env}");
    }
}
