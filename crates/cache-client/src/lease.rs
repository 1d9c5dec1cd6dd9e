//! [`Lease`]: what the cache service hands a registered worker or peer, the capability to
//! pin, reserve, commit and take part in rooms. 128 random bits, so that nobody guesses
//! another's; on the wire it is 16 bytes (`bytes lease`), in logs a short tag, and never
//! in an error message.

use std::fmt;

/// A lease: 128 random bits. Its `Debug` and `Display` show only a tag (the first two
/// bytes) so that logs tell leases apart without handing one out.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease(u128);

/// A `lease` field that is not 16 bytes (INVALID_ARGUMENT at the service).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a lease is 16 bytes, not {0}")]
pub struct BadLease(pub usize);

impl Lease {
    /// Bytes a lease takes on the wire.
    pub const BYTES: usize = 16;

    /// A fresh lease from the thread's cryptographic generator, never zero (zero is what
    /// an unset protobuf field reads as).
    pub fn random() -> Self {
        loop {
            let v: u128 = rand::random();
            if v != 0 {
                return Self(v);
            }
        }
    }

    /// The lease a `bytes lease` field carries.
    pub fn from_wire(b: &[u8]) -> Result<Self, BadLease> {
        let a: [u8; Self::BYTES] = b.try_into().map_err(|_| BadLease(b.len()))?;
        Ok(Self(u128::from_le_bytes(a)))
    }

    /// The 16 bytes a `bytes lease` field carries.
    pub fn to_wire(self) -> Vec<u8> {
        self.to_bytes().to_vec()
    }

    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        self.0.to_le_bytes()
    }

    pub fn from_bytes(b: [u8; Self::BYTES]) -> Self {
        Self(u128::from_le_bytes(b))
    }

    /// A lease made from a number, for unit tests that need fixed leases.
    #[doc(hidden)]
    pub const fn from_test_number(n: u128) -> Self {
        Self(n)
    }
}

impl fmt::Display for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.to_bytes();
        write!(f, "{:02x}{:02x}…", b[0], b[1])
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lease({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_round_trips_its_sixteen_wire_bytes_and_refuses_other_lengths() {
        let l = Lease::random();
        assert_eq!(l.to_wire().len(), 16);
        assert_eq!(Lease::from_wire(&l.to_wire()), Ok(l));
        assert_eq!(Lease::from_wire(&[1; 8]), Err(BadLease(8)));
        assert_eq!(Lease::from_wire(&[]), Err(BadLease(0)));
    }

    #[test]
    fn leases_differ_and_print_only_a_tag() {
        let (a, b) = (Lease::random(), Lease::random());
        assert_ne!(a, b);
        let hex: String = a.to_bytes().iter().map(|x| format!("{x:02x}")).collect();
        for shown in [a.to_string(), format!("{a:?}")] {
            assert!(!shown.contains(&hex[..8]), "{shown} shows more than a tag");
            assert!(shown.contains(&hex[..4]), "{shown} lacks the tag");
        }
    }
}
