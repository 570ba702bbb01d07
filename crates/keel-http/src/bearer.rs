//! Bearer tokens checked by hash: the configuration holds a token's
//! SHA-256, never the token; a presented token is hashed and the digests
//! compared without an early exit.

use http::HeaderMap;
use sha2::{Digest, Sha256};

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let d = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in d {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 15)] as char);
    }
    s
}

/// Whether two digests are equal, in a time that depends only on their
/// lengths.
pub fn same_digest(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in
/// any case, the token trimmed), if there is one.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let v = headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim();
    let (scheme, token) = v.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A configured token hash that is not 64 hexadecimal digits.
#[derive(Debug, thiserror::Error)]
#[error("a token's SHA-256 is 64 hexadecimal digits (`keel serve token` makes a token and its hash); got {len} characters")]
pub struct BadTokenHash {
    pub len: usize,
}

/// The SHA-256 of the one bearer token a listener accepts.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenHash(String);

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A hash is not a secret, but there is no need to print it.
        f.write_str("TokenHash(..)")
    }
}

impl TokenHash {
    /// From 64 hexadecimal digits (either case).
    pub fn parse(hex: &str) -> Result<Self, BadTokenHash> {
        let hex = hex.trim();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BadTokenHash {
                len: hex.chars().count(),
            });
        }
        Ok(Self(hex.to_ascii_lowercase()))
    }

    /// The hash of `token`.
    pub fn of(token: &str) -> Self {
        Self(sha256_hex(token.as_bytes()))
    }

    /// The hash, lowercase hex.
    pub fn as_hex(&self) -> &str {
        &self.0
    }

    /// Whether `token` hashes to this.
    pub fn matches(&self, token: &str) -> bool {
        same_digest(&sha256_hex(token.as_bytes()), &self.0)
    }

    /// Whether the request's `Authorization: Bearer` token hashes to this.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        bearer_token(headers).is_some_and(|t| self.matches(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            auth.parse().expect("header value"),
        );
        h
    }

    #[test]
    fn the_hash_is_sha256_in_lowercase_hex() {
        // printf token | sha256sum
        assert_eq!(
            sha256_hex(b"token"),
            "3c469e9d6c5875d37a43f353d4f88e61fcf812c66eee3457465a40b0da4153e0"
        );
    }

    #[test]
    fn only_the_token_with_the_configured_hash_is_allowed() {
        let t = TokenHash::parse(&sha256_hex(b"s3cret").to_ascii_uppercase()).expect("hash");
        assert!(t.allows(&headers("Bearer s3cret")));
        assert!(t.allows(&headers("bearer   s3cret ")));
        assert!(!t.allows(&headers("Bearer s3cre")));
        assert!(!t.allows(&headers("Basic s3cret")));
        assert!(!t.allows(&headers("Bearer")));
        assert!(!t.allows(&HeaderMap::new()));
        assert_eq!(TokenHash::of("s3cret"), t);
    }

    #[test]
    fn a_hash_that_is_not_64_hex_digits_is_refused() {
        for bad in ["", "abc", &"g".repeat(64), &"a".repeat(65)] {
            let e = TokenHash::parse(bad).expect_err(bad);
            assert!(e.to_string().contains("64 hexadecimal digits"), "{e}");
        }
    }

    #[test]
    fn digests_of_other_lengths_differ() {
        assert!(same_digest("ab", "ab"));
        assert!(!same_digest("ab", "ac"));
        assert!(!same_digest("ab", "abc"));
    }
}
