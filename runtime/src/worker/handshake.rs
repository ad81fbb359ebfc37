//! The first bytes of every connection between processes of a run (data
//! connections and the coordinator's), before any frame is read.
//!
//! Any pod of a cluster can reach a worker's ports, so the side that accepts
//! reads nothing unbounded and waits for nothing unbounded until the peer has
//! proved it belongs to the run:
//!
//! 1. The acceptor sends a challenge: `WEIR`, a version byte and a nonce of
//!    32 random bytes, new for every connection.
//! 2. The connector answers with its hello (a u32 length of at most
//!    [`MAX_HELLO`] bytes, the hello, then an HMAC-SHA256 tag of the nonce and
//!    the hello under the run key, see [`run_key`]).
//! 3. The acceptor checks the tag in constant time; all of it within
//!    [`HANDSHAKE_TIMEOUT`]. Only then are frames (up to 256 MiB) read.
//!
//! The run key never crosses the network, and a recorded answer is worth
//! nothing on another connection: its nonce differs. With TLS (`tls.rs`,
//! `weir worker --tls-dir`), the TLS handshake comes first, within the same
//! deadline, and the challenge and everything after it travel encrypted;
//! without it, what comes after the handshake is neither encrypted nor signed.

use std::sync::Arc;
use std::time::Duration;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::tls::{JobTls, Link};
use crate::error::{Error, Result};

/// The challenge's first bytes, then the protocol version.
const MAGIC: &[u8; 4] = b"WEIR";
const VERSION: u8 = 1;
const NONCE: usize = 32;
const TAG: usize = 32;

/// The largest hello: the data hello and the coordinator's are a few hundred
/// bytes of JSON (a checkpoint path included).
pub const MAX_HELLO: usize = 16 << 10;

/// How long a peer may take to answer the challenge. A process of the run
/// answers at once; a stranger holding the connection open gets this long.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The key only processes of run `run_id` hold: HMAC-SHA256 of the run id
/// under the job's control token, which only the job's own pods (from its
/// Secret) and the operator have. Another job's pods, any other pod, and a
/// process of an earlier run of this job cannot make it.
pub fn run_key(token: &str, run_id: &str) -> RunKey {
    let token_key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
    let tag = hmac::sign(&token_key, format!("weir-run:{run_id}").as_bytes());
    RunKey { hmac: hmac::Key::new(hmac::HMAC_SHA256, tag.as_ref()), tls: None }
}

/// What a process needs to open and accept connections of its run: the run
/// key and, when the job has TLS, its certificates.
#[derive(Clone, Debug)]
pub struct RunKey {
    hmac: hmac::Key,
    tls: Option<Arc<JobTls>>,
}

impl RunKey {
    /// The same key, with connections wrapped in the job's TLS.
    pub fn with_tls(self, tls: Option<Arc<JobTls>>) -> RunKey {
        RunKey { tls, ..self }
    }
}

fn signed(nonce: &[u8], hello: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(16 + nonce.len() + hello.len());
    msg.extend_from_slice(b"weir-hello");
    msg.extend_from_slice(nonce);
    msg.extend_from_slice(hello);
    msg
}

fn refused(peer: &str, message: impl Into<String>) -> Error {
    Error::Protocol { peer: peer.into(), message: message.into() }
}

/// The acceptor's side: (with TLS, completes the TLS handshake, then)
/// challenges the peer and returns the connection and the peer's hello once
/// the tag proves the peer holds `key`. Any failure means the connection is
/// to be dropped; the error says why, for a log line.
pub async fn accept(stream: TcpStream, key: &RunKey, peer: &str) -> Result<(Link, Vec<u8>)> {
    accept_within(stream, key, peer, HANDSHAKE_TIMEOUT).await
}

async fn accept_within(stream: TcpStream, key: &RunKey, peer: &str, within: Duration) -> Result<(Link, Vec<u8>)> {
    let handshake = async {
        let mut link = match &key.tls {
            Some(tls) => tls.accept(stream).await.map_err(|e| refused(peer, format!("TLS handshake failed: {e}")))?,
            None => Link::Left(stream),
        };
        let hello = challenge(&mut link, &key.hmac, peer).await?;
        Ok((link, hello))
    };
    tokio::time::timeout(within, handshake).await.map_err(|_| refused(peer, format!("no hello within {within:?}")))?
}

async fn challenge<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, key: &hmac::Key, peer: &str) -> Result<Vec<u8>> {
    let mut nonce = [0u8; NONCE];
    SystemRandom::new().fill(&mut nonce).map_err(|_| refused(peer, "no randomness for a challenge"))?;
    let exchange = async {
        let mut challenge = Vec::with_capacity(MAGIC.len() + 1 + NONCE);
        challenge.extend_from_slice(MAGIC);
        challenge.push(VERSION);
        challenge.extend_from_slice(&nonce);
        stream.write_all(&challenge).await.map_err(|e| refused(peer, format!("cannot send the challenge: {e}")))?;
        // TLS buffers what is written until it is flushed.
        stream.flush().await.map_err(|e| refused(peer, format!("cannot send the challenge: {e}")))?;
        let len = stream.read_u32().await.map_err(|e| refused(peer, format!("no hello: {e}")))? as usize;
        if len > MAX_HELLO {
            return Err(refused(peer, format!("a hello of {len} bytes: expected at most {MAX_HELLO}")));
        }
        let mut hello = vec![0u8; len + TAG];
        stream.read_exact(&mut hello).await.map_err(|e| refused(peer, format!("hello cut short: {e}")))?;
        Ok(hello)
    };
    let mut hello = exchange.await?;
    let tag = hello.split_off(hello.len() - TAG);
    hmac::verify(key, &signed(&nonce, &hello), &tag).map_err(|_| refused(peer, "without this run's proof"))?;
    Ok(hello)
}

/// The connector's side: (with TLS, completes the TLS handshake, then)
/// answers the acceptor's challenge with `hello`, signed under `key`.
pub async fn offer(stream: TcpStream, key: &RunKey, hello: &[u8], peer: &str) -> Result<Link> {
    if hello.len() > MAX_HELLO {
        return Err(refused(peer, format!("a hello of {} bytes: at most {MAX_HELLO} fit", hello.len())));
    }
    let exchange = async {
        let mut stream = match &key.tls {
            Some(tls) => tls.connect(stream).await.map_err(|e| refused(peer, format!("TLS handshake failed: {e}")))?,
            None => Link::Left(stream),
        };
        let key = &key.hmac;
        let mut challenge = [0u8; MAGIC.len() + 1 + NONCE];
        stream.read_exact(&mut challenge).await.map_err(|e| Error::Network { peer: peer.into(), message: format!("no challenge: {e}") })?;
        if &challenge[..MAGIC.len()] != MAGIC || challenge[MAGIC.len()] != VERSION {
            return Err(refused(peer, "not a weir process of a matching version"));
        }
        let nonce = &challenge[MAGIC.len() + 1..];
        let tag = hmac::sign(key, &signed(nonce, hello));
        let mut answer = Vec::with_capacity(4 + hello.len() + TAG);
        answer.extend_from_slice(&(hello.len() as u32).to_be_bytes());
        answer.extend_from_slice(hello);
        answer.extend_from_slice(tag.as_ref());
        stream.write_all(&answer).await.map_err(|e| Error::Network { peer: peer.into(), message: format!("cannot send the hello: {e}") })?;
        stream.flush().await.map_err(|e| Error::Network { peer: peer.into(), message: format!("cannot send the hello: {e}") })?;
        Ok(stream)
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange)
        .await
        .map_err(|_| Error::Network { peer: peer.into(), message: format!("no challenge within {HANDSHAKE_TIMEOUT:?}") })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, a) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), a.unwrap().0)
    }

    #[tokio::test]
    async fn a_process_of_the_run_is_accepted_with_its_hello() {
        let (c, a) = pair().await;
        let key = run_key("token", "run-1");
        let (offered, accepted) = tokio::join!(offer(c, &key, b"{\"stage\":1}", "a"), accept(a, &key, "c"));
        let mut c = offered.unwrap();
        let (mut a, hello) = accepted.unwrap();
        assert_eq!(hello, b"{\"stage\":1}");
        // The connection goes on as a byte stream: nothing was over-read.
        c.write_all(b"next").await.unwrap();
        let mut next = [0u8; 4];
        a.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"next");
    }

    #[tokio::test]
    async fn with_tls_a_process_of_the_run_is_accepted_and_the_stream_goes_on_encrypted() {
        let dir = super::super::tls::tests::tls_dir("job-workers.ns.svc");
        let tls = Arc::new(JobTls::load(dir.path(), "job-workers.ns.svc").unwrap());
        let key = run_key("token", "run-1").with_tls(Some(tls));
        let (c, a) = pair().await;
        let (offered, accepted) = tokio::join!(offer(c, &key, b"hi", "a"), accept(a, &key, "c"));
        let mut c = offered.unwrap();
        let (mut a, hello) = accepted.unwrap();
        assert_eq!(hello, b"hi");
        assert!(matches!(a, Link::Right(_)));
        c.write_all(b"next").await.unwrap();
        c.flush().await.unwrap();
        let mut next = [0u8; 4];
        a.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"next");
        // A process of the run without TLS cannot talk to one with it: it
        // waits for a challenge that never comes in the clear.
        let (c, a) = pair().await;
        let plain = run_key("token", "run-1");
        let offering = tokio::spawn(async move { offer(c, &plain, b"hi", "a").await.map(|_| ()) });
        let err = accept_within(a, &key, "c", Duration::from_millis(300)).await.unwrap_err().to_string();
        assert!(err.contains("no hello within"), "{err}");
        assert!(offering.await.unwrap().is_err(), "the plain side got a challenge");
    }

    #[tokio::test]
    async fn another_runs_key_or_another_token_is_refused() {
        for (token, run) in [("token", "run-0"), ("other-token", "run-1")] {
            let (c, a) = pair().await;
            let (theirs, ours) = (run_key(token, run), run_key("token", "run-1"));
            let (_, accepted) = tokio::join!(offer(c, &theirs, b"hi", "a"), accept(a, &ours, "c"));
            assert!(accepted.unwrap_err().to_string().contains("without this run's proof"));
        }
    }

    #[tokio::test]
    async fn a_recorded_answer_replayed_on_another_connection_is_refused() {
        let key = run_key("token", "run-1");
        // Record a real process's answer to one challenge.
        let (c, mut a) = pair().await;
        let recorder = async {
            let mut challenge = MAGIC.to_vec();
            challenge.push(VERSION);
            challenge.extend_from_slice(&[7u8; NONCE]);
            a.write_all(&challenge).await.unwrap();
            let mut answer = vec![0u8; 4 + 2 + TAG];
            a.read_exact(&mut answer).await.unwrap();
            answer
        };
        let (recorded, offered) = tokio::join!(recorder, offer(c, &key, b"hi", "a"));
        offered.unwrap();
        // Replay it to an acceptor, whose nonce is new.
        let (mut c, a) = pair().await;
        let replay = async {
            let mut challenge = [0u8; MAGIC.len() + 1 + NONCE];
            c.read_exact(&mut challenge).await.unwrap();
            c.write_all(&recorded).await.unwrap();
        };
        let (_, accepted) = tokio::join!(replay, accept(a, &key, "c"));
        assert!(accepted.unwrap_err().to_string().contains("without this run's proof"));
    }

    #[tokio::test]
    async fn a_huge_length_is_refused_before_anything_is_allocated() {
        let (mut c, a) = pair().await;
        let stranger = async {
            let mut challenge = [0u8; MAGIC.len() + 1 + NONCE];
            c.read_exact(&mut challenge).await.unwrap();
            c.write_all(&(256u32 << 20).to_be_bytes()).await.unwrap();
        };
        let key = run_key("t", "r");
        let (_, accepted) = tokio::join!(stranger, accept(a, &key, "c"));
        assert!(accepted.unwrap_err().to_string().contains("expected at most 16384"));
    }

    #[tokio::test]
    async fn a_peer_that_says_nothing_is_dropped_after_the_timeout() {
        let (_c, a) = pair().await;
        let started = std::time::Instant::now();
        let err = accept_within(a, &run_key("t", "r"), "c", Duration::from_millis(200)).await.unwrap_err().to_string();
        assert!(err.contains("no hello within 200ms"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
