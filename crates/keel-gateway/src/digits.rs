//! Numbers as text into a caller's buffer, for the per-request log lines,
//! labels and headers (no allocation, no formatting machinery).

/// `n` in decimal.
pub fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[i..]).unwrap_or("0")
}

/// `bytes` in lowercase hex into `out`, which must be twice as long.
pub fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const D: &[u8; 16] = b"0123456789abcdef";
    for (b, o) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        o[0] = D[(b >> 4) as usize];
        o[1] = D[(b & 15) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_the_formatter() {
        for n in [0, 7, 10, 99, 200, 404, 65_535, 1 << 40, u64::MAX] {
            assert_eq!(decimal(n, &mut [0; 20]), n.to_string());
            let mut h = [0u8; 16];
            hex_into(&n.to_be_bytes(), &mut h);
            assert_eq!(
                std::str::from_utf8(&h).ok(),
                Some(format!("{n:016x}").as_str())
            );
        }
    }
}
