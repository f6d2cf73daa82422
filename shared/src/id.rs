//! VM identifiers.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A VM's id, unique for the life of one server. Shown as `vm-<n>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct VmId(pub u32);

impl fmt::Display for VmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vm-{}", self.0)
    }
}

/// The text is not a VM id of the form `vm-<n>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a VM id; ids look like vm-1")]
pub struct ParseVmIdError(pub String);

impl FromStr for VmId {
    type Err = ParseVmIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.strip_prefix("vm-")
            .and_then(|n| n.parse().ok())
            .map(VmId)
            .ok_or_else(|| ParseVmIdError(s.chars().take(64).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_display_form() {
        assert_eq!("vm-17".parse::<VmId>(), Ok(VmId(17)));
        assert!("17".parse::<VmId>().is_err());
        assert!("vm-".parse::<VmId>().is_err());
    }

    proptest! {
        #[test]
        fn display_round_trips(n: u32) {
            prop_assert_eq!(VmId(n).to_string().parse::<VmId>(), Ok(VmId(n)));
        }

        #[test]
        fn arbitrary_text_never_panics(s in ".*") {
            let _ = s.parse::<VmId>();
        }
    }
}
