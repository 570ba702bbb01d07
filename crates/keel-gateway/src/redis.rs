//! A minimal Redis client (RESP2 over TCP): enough for `EVAL` of the limit
//! scripts and `PING`, with a small connection pool and a deadline on every
//! call. A failed connection is dropped, never reused.

use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub use crate::config::{redact, RedisAddr};
use crate::error::GatewayError;

const TIMEOUT: Duration = Duration::from_secs(2);
const POOL: usize = 32;

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
