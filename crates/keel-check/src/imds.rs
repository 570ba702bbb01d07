//! Azure Instance Metadata Service: the VM size, to pick a SKU profile.
//! Plain HTTP (ureq, no proxy, no redirects) with one deadline for the
//! whole exchange.

use std::time::Duration;

/// The endpoint Azure VMs reach IMDS at.
pub const DEFAULT_ENDPOINT: &str = "169.254.169.254:80";

/// The most of an answer read.
const MAX_BODY: u64 = 64 * 1024;

/// Asks IMDS at `endpoint` (`host:port`) for `compute/vmSize`. `None` on
/// any failure or timeout: not being on Azure is normal.
pub fn vm_size(endpoint: &str, timeout: Duration) -> Option<String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        // IMDS is link-local: never through a proxy.
        .proxy(None)
        .max_redirects(0)
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into();
    let url = format!(
        "http://{endpoint}/metadata/instance/compute/vmSize?api-version=2021-02-01&format=text"
    );
    let mut resp = agent.get(&url).header("Metadata", "true").call().ok()?;
    if resp.status().as_u16() != 200 {
        return None;
    }
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_BODY)
        .read_to_string()
        .ok()?;
    size(&body)
}

/// A VM size from an answer's body: trimmed, not empty, shorter than 128.
fn size(body: &str) -> Option<String> {
    let v = body.trim();
    (!v.is_empty() && v.len() < 128).then(|| v.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
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
        assert!(req.to_ascii_lowercase().contains("metadata: true"), "{req}");
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

    /// Serves one connection with `resp` and returns the request.
    fn serve_once(resp: &'static [u8]) -> (String, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut req = [0u8; 1024];
            let n = s.read(&mut req).expect("read");
            s.write_all(resp).expect("write");
            String::from_utf8_lossy(&req[..n]).into_owned()
        });
        (addr, server)
    }

    #[test]
    fn responses() {
        let (addr, s) = serve_once(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno");
        assert_eq!(vm_size(&addr, Duration::from_secs(2)), None);
        s.join().expect("server");
        let (addr, s) = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nStand\r\n3\r\nard\r\n0\r\n\r\n");
        assert_eq!(
            vm_size(&addr, Duration::from_secs(2)).as_deref(),
            Some("Standard")
        );
        s.join().expect("server");
        let (addr, s) = serve_once(b"garbage\r\n\r\n");
        assert_eq!(vm_size(&addr, Duration::from_secs(2)), None);
        s.join().expect("server");
        assert_eq!(size(&"x".repeat(200)), None);
        assert_eq!(size("  \n"), None);
    }
}
