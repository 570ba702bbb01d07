//! Whom a connection counts against.

use std::net::IpAddr;

/// A client: its IPv4 address (an IPv4-mapped IPv6 address included), or
/// its IPv6 /64, which is what one host is given (RFC 7421), so a host
/// cannot multiply its share by picking new addresses in its own prefix.
pub fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(a) => {
            let mut s = a.segments();
            s[4..].fill(0);
            IpAddr::V6(s.into())
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_are_ipv4_addresses_and_ipv6_slash_64s() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("address");
        assert_eq!(client_of(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(client_of(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(
            client_of(ip("2001:db8:1:2:aaaa:bbbb:cccc:dddd")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            client_of(ip("2001:db8:1:2::1")),
            client_of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            client_of(ip("2001:db8:1:2::1")),
            client_of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(client_of(ip("::1")), ip("::"));
    }
}
