//! A minimal Redis client (RESP2 over TCP): enough for `EVAL` of the limit
//! scripts and `PING`, with a small connection pool and a deadline on every
//! call. A failed connection is dropped, never reused.

use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::error::GatewayError;

const TIMEOUT: Duration = Duration::from_secs(2);
const POOL: usize = 32;

/// `redis://[[user]:password@]host:port[/db]` (user and password
/// percent-decoded). With a user, keel sends `AUTH user password` (a Redis
/// 6 ACL user); without, `AUTH password` (the `default` user).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisAddr {
    pub host_port: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: Option<u32>,
}

impl RedisAddr {
    pub fn parse(url: &str) -> Result<Self, GatewayError> {
        let bad = |reason: &str| GatewayError::Redis {
            url: redact(url),
            reason: reason.into(),
        };
        let rest = url
            .strip_prefix("redis://")
            .ok_or_else(|| bad("only redis:// URLs are supported"))?;
        let (auth, hostpart) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let (username, password) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (
                    Some(percent_decode(u).ok_or_else(|| bad("bad %-escape in the user"))?)
                        .filter(|u| !u.is_empty()),
                    Some(percent_decode(p).ok_or_else(|| bad("bad %-escape in the password"))?),
                ),
                None => (
                    None,
                    Some(percent_decode(a).ok_or_else(|| bad("bad %-escape in the password"))?),
                ),
            },
        };
        let (host_port, db) = match hostpart.split_once('/') {
            Some((h, "")) => (h, None),
            Some((h, d)) => (
                h,
                Some(d.parse().map_err(|_| bad("the database is not a number"))?),
            ),
            None => (hostpart, None),
        };
        if host_port.is_empty() {
            return Err(bad("no host"));
        }
        let host_port = if host_port.contains(':') {
            host_port.to_owned()
        } else {
            format!("{host_port}:6379")
        };
        Ok(Self {
            host_port,
            username,
            password,
            db,
        })
    }
}

/// `%XX` escapes of a URL's user or password; `None` for a bad escape or
/// bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The URL with any password replaced, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(a)) if a > s => format!("{}***{}", &url[..s + 3], &url[a..]),
        _ => url.to_owned(),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

type Conn = BufReader<TcpStream>;

#[derive(Debug)]
pub struct RedisClient {
    addr: RedisAddr,
    url: String,
    pool: Mutex<Vec<Conn>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis error: {0}")]
    Server(String),
    #[error("unexpected reply: {0}")]
    Protocol(String),
}

impl RedisClient {
    pub fn new(url: &str) -> Result<Self, GatewayError> {
        Ok(Self {
            addr: RedisAddr::parse(url)?,
            url: redact(url),
            pool: Mutex::new(Vec::new()),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    async fn connect(&self) -> Result<Conn, RedisError> {
        let s = TcpStream::connect(&self.addr.host_port).await?;
        s.set_nodelay(true)?;
        let mut c = BufReader::new(s);
        match (&self.addr.username, &self.addr.password) {
            (Some(u), Some(p)) => {
                check_ok(roundtrip(&mut c, &[b"AUTH", u.as_bytes(), p.as_bytes()]).await?)?
            }
            (None, Some(p)) => check_ok(roundtrip(&mut c, &[b"AUTH", p.as_bytes()]).await?)?,
            _ => {}
        }
        if let Some(db) = self.addr.db {
            check_ok(roundtrip(&mut c, &[b"SELECT", db.to_string().as_bytes()]).await?)?;
        }
        Ok(c)
    }

    /// Runs one command on a pooled connection, under the deadline.
    pub async fn command(&self, args: &[&[u8]]) -> Result<Reply, RedisError> {
        let fut = async {
            let pooled = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let mut conn = match pooled {
                Some(c) => c,
                None => self.connect().await?,
            };
            let reply = roundtrip(&mut conn, args).await?;
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < POOL {
                pool.push(conn);
            }
            Ok(reply)
        };
        match tokio::time::timeout(TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::Timeout(TIMEOUT)),
        }
    }

    /// `EVAL script keys args`, expecting an integer or an array of them.
    pub async fn eval_ints(
        &self,
        script: &str,
        keys: &[String],
        args: &[String],
    ) -> Result<Vec<i64>, RedisError> {
        let n = keys.len().to_string();
        let mut argv: Vec<&[u8]> = vec![b"EVAL", script.as_bytes(), n.as_bytes()];
        argv.extend(keys.iter().map(|k| k.as_bytes()));
        argv.extend(args.iter().map(|a| a.as_bytes()));
        match self.command(&argv).await? {
            Reply::Int(i) => Ok(vec![i]),
            Reply::Array(Some(items)) => items
                .into_iter()
                .map(|r| match r {
                    Reply::Int(i) => Ok(i),
                    other => Err(RedisError::Protocol(format!("{other:?}"))),
                })
                .collect(),
            Reply::Error(e) => Err(RedisError::Server(e)),
            other => Err(RedisError::Protocol(format!("{other:?}"))),
        }
    }

    pub async fn ping(&self) -> Result<(), RedisError> {
        check_ok(self.command(&[b"PING"]).await?)
    }
}

fn check_ok(r: Reply) -> Result<(), RedisError> {
    match r {
        Reply::Simple(_) => Ok(()),
        Reply::Error(e) => Err(RedisError::Server(e)),
        other => Err(RedisError::Protocol(format!("{other:?}"))),
    }
}

async fn roundtrip(c: &mut Conn, args: &[&[u8]]) -> Result<Reply, RedisError> {
    let mut buf = Vec::with_capacity(64 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        buf.extend_from_slice(a);
        buf.extend_from_slice(b"\r\n");
    }
    c.get_mut().write_all(&buf).await?;
    read_reply(c, 0).await
}

async fn read_line(c: &mut Conn) -> Result<String, RedisError> {
    let mut line = Vec::new();
    let n = c.read_until(b'\n', &mut line).await?;
    if n == 0 {
        return Err(RedisError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    if line.len() < 3 || !line.ends_with(b"\r\n") {
        return Err(RedisError::Protocol("bad line".into()));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| RedisError::Protocol("not UTF-8".into()))
}

fn read_reply(
    c: &mut Conn,
    depth: u32,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Reply, RedisError>> + Send + '_>> {
    Box::pin(async move {
        if depth > 8 {
            return Err(RedisError::Protocol("nested too deep".into()));
        }
        let line = read_line(c).await?;
        if !line.is_char_boundary(1) {
            return Err(RedisError::Protocol("unknown reply type".into()));
        }
        let (kind, rest) = line.split_at(1);
        let num = || {
            rest.parse::<i64>()
                .map_err(|_| RedisError::Protocol(format!("bad number {rest:?}")))
        };
        Ok(match kind {
            "+" => Reply::Simple(rest.to_owned()),
            "-" => Reply::Error(rest.to_owned()),
            ":" => Reply::Int(num()?),
            "$" => {
                let n = num()?;
                if n < 0 {
                    Reply::Bulk(None)
                } else {
                    let mut data = vec![0; n as usize + 2];
                    c.read_exact(&mut data).await?;
                    data.truncate(n as usize);
                    Reply::Bulk(Some(data))
                }
            }
            "*" => {
                let n = num()?;
                if n < 0 {
                    Reply::Array(None)
                } else {
                    let mut items = Vec::with_capacity(n.min(1024) as usize);
                    for _ in 0..n {
                        items.push(read_reply(c, depth + 1).await?);
                    }
                    Reply::Array(Some(items))
                }
            }
            _ => return Err(RedisError::Protocol(format!("unknown reply type {kind:?}"))),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let a = RedisAddr::parse("redis://:secret@127.0.0.1:6380/2").expect("ok");
        assert_eq!(a.host_port, "127.0.0.1:6380");
        assert_eq!(a.password.as_deref(), Some("secret"));
        assert_eq!(a.username, None);
        let u = RedisAddr::parse("redis://keel:p%40ss%3Aw@h:1").expect("ok");
        assert_eq!(u.username.as_deref(), Some("keel"));
        assert_eq!(u.password.as_deref(), Some("p@ss:w"));
        assert!(RedisAddr::parse("redis://u:%zz@h").is_err());
        assert_eq!(a.db, Some(2));
        assert_eq!(
            RedisAddr::parse("redis://h").expect("ok").host_port,
            "h:6379"
        );
        assert!(RedisAddr::parse("rediss://h").is_err());
        assert_eq!(redact("redis://:secret@h:1"), "redis://***@h:1");
    }
}
