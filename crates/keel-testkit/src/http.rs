//! A blocking HTTP/1.1 client for tests: one request per connection
//! (`Connection: close`), Content-Length and chunked bodies, and a raw
//! socket for tests that misbehave on purpose (slow or oversized clients).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (`Null` if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Sends one request and reads the whole response (30 s at most).
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<HttpResponse> {
    let s = connect(addr)?;
    exchange(s, &addr.to_string(), method, path, headers, body)
}

/// A TCP connection for one request: 5 s to connect, 30 s per read.
pub fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Sends one request on an open stream (plain or TLS) and reads the whole
/// response.
pub fn exchange<S: Read + Write>(
    mut s: S,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<HttpResponse> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut buf = req.into_bytes();
    buf.extend_from_slice(body);
    s.write_all(&buf)?;
    s.flush()?;
    read_response(&mut BufReader::new(s))
}

/// `POST` a JSON body with a bearer token.
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    token: &str,
    body: &serde_json::Value,
) -> io::Result<HttpResponse> {
    let auth = format!("Bearer {token}");
    request(
        addr,
        "POST",
        path,
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ],
        body.to_string().as_bytes(),
    )
}

/// `GET` with a bearer token.
pub fn get(addr: SocketAddr, path: &str, token: &str) -> io::Result<HttpResponse> {
    let auth = format!("Bearer {token}");
    request(addr, "GET", path, &[("Authorization", &auth)], b"")
}

pub fn read_response(r: &mut impl BufRead) -> io::Result<HttpResponse> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_owned());
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(&format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let n = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad("bad chunk size"))?;
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk)?;
            chunk.truncate(n);
            body.extend(chunk);
        }
    } else if let Some(n) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}
