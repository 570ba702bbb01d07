//! FNV-1a, the hash of the gateway's own lookup tables on the request
//! path: backend authorities (the connection pool) and metric label values.
//! Keys that come from the configuration or are compared by value after
//! the hash need no protection against chosen collisions, and FNV-1a costs
//! a fraction of std's SipHash on short keys.

use std::hash::Hasher;

/// FNV-1a, 64 bits, as a [`Hasher`] (`BuildHasherDefault<Fnv>` for maps).
#[derive(Debug, Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // The FNV-1a 64 reference values for "" and "a".
        assert_eq!(Fnv::default().finish(), 0xcbf2_9ce4_8422_2325);
        let mut h = Fnv::default();
        h.write(b"a");
        assert_eq!(h.finish(), 0xaf63_dc4c_8601_ec8c);
    }
}
