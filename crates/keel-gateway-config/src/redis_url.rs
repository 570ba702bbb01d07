//! A Redis URL (`redis://[[user]:password@]host:port[/db]`) and its
//! redaction for messages.

use crate::ConfigError;

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
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::Redis {
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
