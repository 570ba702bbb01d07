//! API-key secrets: `keel_` and 43 characters of URL-safe base64 (32
//! random bytes). Only their SHA-256 is stored.

use base64::Engine as _;
use rand_core::RngCore as _;

/// A new random secret.
pub fn new_secret() -> String {
    let mut b = [0u8; 32];
    rand_core::OsRng.fill_bytes(&mut b);
    format!(
        "keel_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    )
}

/// SHA-256 (hex) of a secret, as stored and as `serve_token_sha256` takes it.
pub fn secret_hash(secret: &str) -> String {
    keel_store::Digest::of(secret.as_bytes()).hex()
}
