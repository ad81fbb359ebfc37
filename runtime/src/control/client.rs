//! A minimal HTTP/1.1 client for the control endpoint: the CLI, the local
//! supervisor and the tests talk to it on loopback or inside a cluster, so
//! one request per connection, no TLS, no redirects.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::{Error, Result};

/// Sends one request (with a JSON `body` if given) and returns the status
/// code and the body of the answer.
pub async fn call(addr: SocketAddr, method: &str, path: &str, token: &str, body: Option<&[u8]>, timeout: Duration) -> Result<(u16, String)> {
    let fut = async {
        let io = |e| Error::io(format!("control endpoint at {addr}"))(e);
        let mut s = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
        let body = body.unwrap_or_default();
        let content_type = if body.is_empty() { "" } else { "Content-Type: application/json\r\n" };
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n{content_type}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.map_err(io)?;
        s.write_all(body).await.map_err(io)?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.map_err(io)?;
        Ok(parse_response(&buf))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| Error::Network { peer: addr.to_string(), message: "the control endpoint did not answer in time".into() })?
}

/// Status code (0 when unreadable) and body of a whole HTTP/1.1 response.
fn parse_response(bytes: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(bytes);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked { dechunk(body) } else { body.to_string() };
    (code, body)
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || after.len() < n || !after.is_char_boundary(n) {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_plain_and_chunked_are_read() {
        assert_eq!(parse_response(b"HTTP/1.1 202 Accepted\r\ncontent-length: 2\r\n\r\n{}"), (202, "{}".into()));
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), (200, "abcde".into()));
        assert_eq!(parse_response(b"garbage"), (0, String::new()));
        // A chunk size beyond the body must not panic.
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nff\r\nab"), (200, String::new()));
    }
}
