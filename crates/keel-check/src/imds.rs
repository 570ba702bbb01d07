//! Azure Instance Metadata Service: the VM size, to pick a SKU profile.
//! Plain HTTP/1.1 over a socket with short timeouts; no client library.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The endpoint Azure VMs reach IMDS at.
pub const DEFAULT_ENDPOINT: &str = "169.254.169.254:80";

/// Asks IMDS at `endpoint` (`host:port`) for `compute/vmSize`. `None` on
/// any failure or timeout: not being on Azure is normal.
pub fn vm_size(endpoint: &str, timeout: Duration) -> Option<String> {
    let addr = endpoint.to_socket_addrs().ok()?.next()?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    let req = format!(
        "GET /metadata/instance/compute/vmSize?api-version=2021-02-01&format=text HTTP/1.1\r\nHost: {endpoint}\r\nMetadata: true\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(req.as_bytes()).ok()?;
    let mut buf = Vec::new();
    stream.take(64 * 1024).read_to_end(&mut buf).ok()?;
    parse_response(&String::from_utf8_lossy(&buf))
}

/// The body of a `200` response, trimmed; `None` otherwise.
fn parse_response(resp: &str) -> Option<String> {
    let (head, body) = resp.split_once("\r\n\r\n")?;
    let status = head.lines().next()?;
    if status.split_whitespace().nth(1) != Some("200") {
        return None;
    }
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    let v = body.trim().to_owned();
    (!v.is_empty() && v.len() < 128).then_some(v)
}

fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        body = rest.get(n + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn reads_vm_size_from_a_local_server() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut req = [0u8; 1024];
            let n = s.read(&mut req).expect("read");
            let req = String::from_utf8_lossy(&req[..n]).into_owned();
            s.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nStandard_ND96isr_H100_v5",
            )
            .expect("write");
            req
        });
        assert_eq!(
            vm_size(&addr, Duration::from_secs(2)).as_deref(),
            Some("Standard_ND96isr_H100_v5")
        );
        let req = server.join().expect("server");
        assert!(req.contains("Metadata: true"), "{req}");
    }

    #[test]
    fn silent_or_absent_endpoint_is_none_within_the_timeout() {
        // A listener that never answers.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let start = std::time::Instant::now();
        assert_eq!(vm_size(&addr, Duration::from_millis(300)), None);
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(l);
        assert_eq!(vm_size("127.0.0.1:1", Duration::from_millis(300)), None);
    }

    #[test]
    fn responses() {
        assert_eq!(parse_response("HTTP/1.1 404 Not Found\r\n\r\nno"), None);
        assert_eq!(parse_response("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nStand\r\n3\r\nard\r\n0\r\n\r\n").as_deref(), Some("Standard"));
        assert_eq!(parse_response("garbage"), None);
    }
}
